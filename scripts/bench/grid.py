"""The end-to-end mode (default) and the context sweep (--sweep-context): every configuration x
batch size x context, decode timed after prefill, repeats interleaved within a (batch, context)
group so noise on a shared machine hits all policies alike, the median reported."""
from __future__ import annotations

import functools
import statistics
import sys

from bench.collectives import collective_share
from bench.measure import measure_e2e, release, warm_up
from bench.report import print_e2e, print_e2e_header
from bench.roofline import decode_bound
from bench.runner import Bench
from bench.specs import CAPACITY_MARGIN, Config, parse_context_range, parse_sweep

SWEEP_DEFAULT = "256:8192"     # --sweep-context without a value

# the measured fields of e2e/sweep rows (null in skipped and error rows)
E2E_MEASURES = ["policy_config", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_per_seq",
                "decode_step_ms", "decode_tokens_per_s_samples", "kv_bytes_allocated", "kv_bytes_live",
                "kv_bytes_read_per_step", "weight_bytes", "bytes_per_step", "read_bandwidth_gbs",
                "bandwidth_bound_tokens_per_s", "fraction_of_bound", "peak_memory_bytes", "peak_memory_kind",
                "decode_recompiles", "cuda_graphs_recorded", "static_decode_steps"]


class E2EMode:
    """The default mode: a prompt of exactly C tokens for B sequences, then --decode-steps timed
    greedy decode steps, for every configuration x --batch-sizes x --context-lengths."""
    name = "e2e"

    def add_arguments(self, parser, exclusive) -> None:
        pass  # the common flags are all it needs

    def check(self, o) -> None:
        pass

    def selected(self, o) -> bool:
        return True

    def contexts(self, bench: Bench) -> list[int]:
        return bench.opts.context_list

    def run(self, bench: Bench) -> None:
        o = bench.opts
        print_e2e_header(o.reference, o.compile == "both")
        for batch in o.batch_list:
            for context in self.contexts(bench):
                runnable = [cfg for cfg in bench.configs() if not self.report_unrunnable(bench, cfg, batch, context)]
                if runnable:
                    self.measure_group(bench, runnable, batch, context)

    def report_unrunnable(self, bench: Bench, cfg: Config, batch: int, context: int) -> bool:
        """Write cfg's skipped/error row when it cannot run at (batch, context); True if it did."""
        o = bench.opts
        problem = bench.cannot_run(cfg, context, o.warmup_steps + o.decode_steps)
        if problem:
            self.add_row(bench, bench.fail_row(bench.base_row(self.name, cfg, batch, context), *problem,
                                               E2E_MEASURES))
        return problem is not None

    def measure_group(self, bench: Bench, configs: list[Config], batch: int, context: int) -> None:
        """--repeats rounds over `configs` on one prompt [batch, context]; each configuration gets an
        untimed warm-up in round 0, and its row after the last round (or an error row at once)."""
        o = bench.opts
        tokens = bench.prompt(batch, context)
        samples: dict[Config, list[dict]] = {cfg: [] for cfg in configs}
        for r in range(o.repeats):
            for cfg in [c for c in configs if c in samples]:
                s, error = bench.attempt(functools.partial(timed_run, bench, cfg, tokens, r == 0))
                if error:
                    del samples[cfg]
                    self.add_row(bench, bench.fail_row(bench.base_row(self.name, cfg, batch, context), "error",
                                                       error, E2E_MEASURES))
                    continue
                samples[cfg].append(s)
                print(f"  [{r + 1}/{o.repeats}] {cfg.label} B={batch} ctx={context}: decode "
                      f"{batch * o.decode_steps / s['decode_s']:.2f} tok/s, prefill "
                      f"{batch * context / s['prefill_s']:.1f} tok/s", file=sys.stderr, flush=True)
                if r == o.repeats - 1:
                    self.add_row(bench, with_collectives(bench, cfg, tokens,
                                                         e2e_row(bench, self.name, cfg, batch, context, samples[cfg])))
        release(bench.model)

    @staticmethod
    def add_row(bench: Bench, row: dict) -> None:
        bench.writer.add(row)
        print_e2e(row, bench.opts.reference, bench.opts.compile == "both")


class SweepMode(E2EMode):
    """--sweep-context [R]: the e2e measurement over a range of contexts (decode cost growth)."""
    name = "sweep"

    def add_arguments(self, parser, exclusive) -> None:
        exclusive.add_argument("--sweep-context", nargs="?", const=SWEEP_DEFAULT, metavar="START:STOP[:F]|LIST",
                               help=f"decode step time versus context (default range {SWEEP_DEFAULT}, "
                                    f"doubling; capped to the model's context)")

    def check(self, o) -> None:
        if o.sweep_context:
            parse_context_range(o.sweep_context)

    def selected(self, o) -> bool:
        return bool(o.sweep_context)

    def contexts(self, bench: Bench) -> list[int]:
        o = bench.opts
        return parse_sweep(o.sweep_context, bench.model.args.max_position_embeddings,
                           o.warmup_steps + o.decode_steps + CAPACITY_MARGIN)


def timed_run(bench: Bench, cfg: Config, tokens, warm: bool) -> dict:
    """One timed run of cfg on tokens [B, T] (measure_e2e's sample), after the configuration's
    untimed warm-up when `warm`."""
    o = bench.opts
    if warm:
        warm_up(bench.model, cfg, tokens, o.decode_steps, o.warmup_steps, o.prefill_chunk, bench.meter)
    return measure_e2e(bench.model, cfg, tokens, o.decode_steps, o.warmup_steps, o.prefill_chunk, bench.meter)


def with_collectives(bench: Bench, cfg: Config, tokens, row: dict) -> dict:
    """Under --tp, the row plus the collectives' share of a decode step (bench/collectives.py)."""
    o = bench.opts
    if o.tp > 1:
        shares, error = bench.attempt(functools.partial(collective_share, bench.model, cfg, tokens,
                                                        min(o.decode_steps, 16), o.prefill_chunk))
        row.update(shares or {"tp_collective_error": error})
    return row


def e2e_row(bench: Bench, mode: str, cfg: Config, batch: int, context: int, samples: list[dict]) -> dict:
    """The row of one configuration from its repeats' samples (medians; peak = max; counters summed)."""
    o = bench.opts
    row = bench.base_row(mode, cfg, batch, context)
    decode_s = statistics.median(s["decode_s"] for s in samples)
    prefill_s = statistics.median(s["prefill_s"] for s in samples)
    kv_read = statistics.median(s["kv_read"] for s in samples)
    bytes_per_step, bound = decode_bound(batch, bench.weight_bytes, kv_read, bench.bandwidth_gbs)
    tps = batch * o.decode_steps / decode_s
    cuda_graphs = [s["cuda_graphs_recorded"] for s in samples]
    row.update({
        "policy_config": samples[-1]["policy_config"],
        "prefill_tokens_per_s": batch * context / prefill_s,
        "decode_tokens_per_s": tps,
        "decode_tokens_per_s_per_seq": o.decode_steps / decode_s,
        "decode_step_ms": 1000 * decode_s / o.decode_steps,
        "decode_tokens_per_s_samples": [batch * o.decode_steps / s["decode_s"] for s in samples],
        "kv_bytes_allocated": samples[-1]["kv_allocated"], "kv_bytes_live": samples[-1]["kv_live"],
        "kv_bytes_read_per_step": int(kv_read), "weight_bytes": bench.weight_bytes,
        "bytes_per_step": int(bytes_per_step), "read_bandwidth_gbs": bench.bandwidth_gbs,
        "bandwidth_bound_tokens_per_s": bound, "fraction_of_bound": tps / bound if bound else None,
        "peak_memory_bytes": max(s["peak"] for s in samples), "peak_memory_kind": bench.meter.kind,
        "decode_recompiles": sum(s["decode_recompiles"] for s in samples),
        "cuda_graphs_recorded": None if cuda_graphs[0] is None else sum(cuda_graphs),
        "static_decode_steps": None if samples[0]["static_steps"] is None else sum(s["static_steps"] for s in samples),
        "status": "ok", "error": None,
    })
    if o.compile == "both":
        row["compile_speedup"] = None   # filled by report.add_ratios
    if row["decode_recompiles"]:
        print(f"  WARNING: {row['decode_recompiles']} graph(s) compiled inside timed decode loops", file=sys.stderr)
    if row["cuda_graphs_recorded"]:
        print(f"  WARNING: {row['cuda_graphs_recorded']} CUDA graph(s) recorded inside timed decode loops "
              f"(a capture inside a timed loop: the warm-up did not meet that batch size and read bucket)", file=sys.stderr)
    return row
