"""--memory-limit L: the largest batch per configuration that fits L for a prompt of each
--context-lengths plus --decode-steps generated tokens.

Model: total(B) = base + state_fixed + B * state_per_seq + workspace_fixed + B * workspace_per_seq,
measured at B=1 and at a probe batch P (probe_batch) and fitted linearly; the answer is
floor((limit * (1 - headroom) - fixed) / per_seq).  While affordable, that batch is then really run
and the line refitted through the two largest real peaks, for at most --verify-runs runs.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from bench.measure import release, run_request, warm_up
from bench.report import fmt_bytes, print_memory, print_memory_header
from bench.runner import Bench
from bench.specs import BenchmarkError, Config, parse_bytes, require_positive

# the measured fields of memory rows (null in skipped and error rows)
MEM_MEASURES = ["max_batch_size", "model_batch_size", "predicted_bytes", "base_bytes", "state_bytes_fixed",
                "state_bytes_per_seq", "kv_bytes_allocated_per_seq", "workspace_bytes_fixed",
                "workspace_bytes_per_seq", "probe_batch_size", "verified", "verified_batch_size",
                "verified_peak_bytes", "verified_within_limit", "prediction_error", "verify_runs", "verify_note"]


@dataclass(frozen=True)
class Line:
    """Bytes of a batch of B sequences: fixed + B * per."""
    fixed: float
    per: float

    def batch(self, budget: float, max_batch: int) -> int:
        """The largest batch whose bytes stay within `budget` (0 if none), at most max_batch."""
        return int(min(max_batch, max(0, (budget - self.fixed) // self.per)))


class MemoryMode:
    """One row per configuration x context x limit (rows keep no batch_size)."""
    name = "memory"

    def add_arguments(self, parser, exclusive) -> None:
        exclusive.add_argument("--memory-limit", metavar="SIZE[,SIZE]",
                               help="largest batch per policy under this memory (e.g. 8GiB or 4GiB,8GiB)")
        parser.add_argument("--verify-seconds", type=float, default=120.0,
                            help="--memory-limit: run the chosen batch when estimated to take at most this long")
        parser.add_argument("--memory-headroom", type=float, default=0.05,
                            help="--memory-limit: fraction of the limit kept free for allocator slack and "
                                 "fragmentation (the model's prediction error was 1-4%% on the CI machine)")
        parser.add_argument("--verify-runs", type=int, default=3,
                            help="--memory-limit: at most this many real runs per policy and limit (refit after each)")
        parser.add_argument("--max-batch", type=int, default=65536, help="--memory-limit: upper end of the search")

    def check(self, o) -> None:
        if o.verify_runs < 0:
            raise BenchmarkError("--verify-runs must be >= 0")
        require_positive(o, "max_batch")
        if not 0 <= o.memory_headroom < 1:
            raise BenchmarkError("--memory-headroom must be in [0, 1)")
        o.memory_limits = [parse_bytes(x) for x in o.memory_limit.split(",")] if o.memory_limit else []

    def selected(self, o) -> bool:
        return bool(o.memory_limit)

    def run(self, bench: Bench) -> None:
        o = bench.opts
        print_memory_header()
        for context in o.context_list:
            for cfg in bench.configs():
                rows = [bench.base_row(self.name, cfg, None, context) | {"memory_limit_bytes": lim}
                        for lim in o.memory_limits]
                problem = bench.cannot_run(cfg, context, o.decode_steps)
                if problem is None:
                    prof, error = bench.attempt(functools.partial(memory_profile, bench, cfg, context))
                    problem = ("error", error) if error else None
                if problem:
                    for row in rows:
                        bench.writer.add(bench.fail_row(row, *problem, MEM_MEASURES))
                    continue
                verified: dict[int, int] = {}
                for row in rows:
                    row.pop("batch_size")
                    fit_batch(bench, cfg, context, prof, row, verified)
                    bench.writer.add(row)
                    print_memory(row)


def probe_batch(context: int) -> int:
    """The second batch size measured: large enough that per-sequence workspace stands out of
    the allocator's noise (at least 2048 prompt tokens in all), at most 64."""
    return max(2, min(64, math.ceil(2048 / context)))


def memory_profile(bench: Bench, cfg: Config, context: int) -> dict:
    """State and workspace bytes at B=1 and B=P (probe_batch), the resident base, run times."""
    model, o = bench.model, bench.opts
    P = probe_batch(context)
    # weights paged in, kernels and graphs initialised: none of that is per-request workspace
    warm_up(model, cfg, bench.prompt(1, context), o.decode_steps, 0, o.prefill_chunk, bench.meter)
    release(model)
    base = bench.meter.current()
    one, probe = (run_request(model, cfg, bench.prompt(B, context), o.decode_steps, o.prefill_chunk, bench.meter)
                  for B in (1, P))
    per_seq = max(1, math.ceil((probe["state"] - one["state"]) / (P - 1)))
    ws_per_seq = max(0, math.ceil((probe["workspace"] - one["workspace"]) / (P - 1)))
    return {"base": base, "probe_batch": P, "peak_b1": one["peak"], "state_per_seq": per_seq,
            "state_fixed": max(0, one["state"] - per_seq),
            "kv_per_seq": (probe["kv"] - one["kv"]) // (P - 1), "ws_per_seq": ws_per_seq,
            "ws_fixed": max(0, one["workspace"] - ws_per_seq),
            "prefill_s": (one["prefill_s"], probe["prefill_s"]), "decode_s": (one["decode_s"], probe["decode_s"])}


def estimate_seconds(prof: dict, batch: int) -> float:
    """Run time at `batch`, extrapolated linearly from B=1 and B=P (prefill and decode apart)."""
    P = prof["probe_batch"]
    return sum(t1 + max(0.0, (tp - t1) / (P - 1)) * (batch - 1) for t1, tp in (prof["prefill_s"], prof["decode_s"]))


def verify_batch(bench: Bench, cfg: Config, batch: int, context: int) -> int:
    """Actually run `batch` sequences of prompt + generation; the peak memory of that run."""
    o = bench.opts
    return run_request(bench.model, cfg, bench.prompt(batch, context), o.decode_steps, o.prefill_chunk,
                       bench.meter)["peak"]


def refit(prof: dict, verified: dict[int, int]) -> Line:
    """The line through the two largest real runs (with the B=1 peak while there is one)."""
    points = sorted((rb, rp) for rb, rp in verified.items() if rp is not None and rb > 1)[-2:]
    (b0, p0), (b1, p1) = ([(1, prof["peak_b1"])] + points)[-2:]
    slope = max(1.0, (p1 - p0) / (b1 - b0))
    return Line(p1 - b1 * slope, slope)


def fit_batch(bench: Bench, cfg: Config, context: int, prof: dict, row: dict, verified: dict[int, int]) -> None:
    """The batch for row["memory_limit_bytes"]: the linear model's answer, then (when the runs
    are affordable) up to --verify-runs real runs, each refitting the line through the two
    largest real peaks (the B=1 peak while only one run exists); the answer is the largest run
    batch within the limit.  `verified` caches {batch: peak} across the limits of one policy,
    and a later limit starts from the line of the runs already made."""
    o = bench.opts
    limit = row["memory_limit_bytes"]
    budget = limit * (1 - o.memory_headroom)
    line = Line(prof["base"] + prof["state_fixed"] + prof["ws_fixed"], prof["state_per_seq"] + prof["ws_per_seq"])
    model_b = line.batch(budget, o.max_batch)
    predicted = line.fixed + model_b * line.per
    row.update({
        "max_batch_size": model_b, "model_batch_size": model_b, "predicted_bytes": predicted,
        "base_bytes": prof["base"], "state_bytes_fixed": prof["state_fixed"],
        "state_bytes_per_seq": prof["state_per_seq"], "kv_bytes_allocated_per_seq": prof["kv_per_seq"],
        "workspace_bytes_fixed": prof["ws_fixed"], "workspace_bytes_per_seq": prof["ws_per_seq"],
        "probe_batch_size": prof["probe_batch"], "verified": None, "prediction_error": None,
        "verified_batch_size": None, "verified_peak_bytes": None, "verified_within_limit": None,
        "verify_runs": [], "verify_note": None, "status": "ok", "error": None,
    })
    if any(rp is not None and rb > 1 for rb, rp in verified.items()):
        line = refit(prof, verified)  # runs made for another limit: start from their line
    runs, line = verify_runs(bench, cfg, context, prof, row, verified, line)
    if verified.get(model_b) is not None:
        row["prediction_error"] = verified[model_b] / predicted - 1
    conclude(row, runs, line.batch(budget, o.max_batch))


def verify_runs(bench: Bench, cfg: Config, context: int, prof: dict, row: dict, verified: dict[int, int],
                line: Line) -> tuple[list[tuple[int, int]], Line]:
    """Real runs from the line's batch on, refitting after each, while affordable: ([(batch, peak)]
    in run order, the last line).  Sets row["max_batch_size"] to the line's first answer and
    row["verify_note"] when it stops early."""
    o = bench.opts
    limit = row["memory_limit_bytes"]
    budget = limit * (1 - o.memory_headroom)
    room = bench.meter.available() + bench.meter.current() - prof["base"]
    b, runs = line.batch(budget, o.max_batch), []
    row["max_batch_size"] = b  # the best estimate until a run says otherwise
    while b >= 1:
        if b not in verified:
            if len(runs) >= o.verify_runs:
                break
            note = why_not_run(o, prof, line, b, room)
            if note:
                row["verify_note"] = note
                break
            verified[b], error = bench.attempt(functools.partial(verify_batch, bench, cfg, b, context))
            if error:  # e.g. a real out-of-memory: counts as not fitting
                row["verify_note"] = f"batch {b} failed: {error}"
                break
        runs.append((b, verified[b]))
        if verified[b] is None or b == 1:
            break
        line = refit(prof, verified)
        nxt = line.batch(budget, o.max_batch)
        if (verified[b] <= limit and nxt <= b) or nxt in dict(runs):
            break   # fits and the refit does not promise more, or it points at a batch already run
        b = nxt
    if b < 1:
        row["verify_note"] = "not even one sequence fits"
    return runs, line


def why_not_run(o, prof: dict, line: Line, b: int, room: float):
    """Why batch b is not run (would not fit this machine, or would take too long), or None."""
    predicted = line.fixed + b * line.per
    if predicted - prof["base"] > 0.8 * room:
        return f"batch {b} not run: predicted {fmt_bytes(predicted)} exceeds this machine"
    est = estimate_seconds(prof, b)
    if est > o.verify_seconds:
        return f"batch {b} not run: estimated {est:.0f} s > --verify-seconds {o.verify_seconds:g}"
    return None


def conclude(row: dict, runs: list[tuple[int, int]], estimate: int) -> None:
    """The answer from the real runs: the largest run batch within the limit (verified), else
    below the smallest run batch and at most the refitted line's `estimate` (verified = false)."""
    limit = row["memory_limit_bytes"]
    row["verify_runs"] = [[rb, rp] for rb, rp in runs]
    fitting = [(rb, rp) for rb, rp in runs if rp is not None and rp <= limit]
    if fitting:
        best, peak = max(fitting)
        row.update(max_batch_size=best, verified=True, verified_batch_size=best, verified_peak_bytes=peak,
                   verified_within_limit=True)
    elif runs:
        rb, rp = runs[-1]
        row.update(max_batch_size=min(estimate, min(r[0] for r in runs) - 1), verified=False,
                   verified_batch_size=rb, verified_peak_bytes=rp, verified_within_limit=False)
        row["verify_note"] = row["verify_note"] or "no run batch fitted; answer from the refitted model"
