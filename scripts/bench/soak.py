"""--soak N: a long run.  After a prompt of each --context-lengths, N greedy decode steps under each
configuration (batch 1 by default), and every --soak-every steps (500) a window is recorded: the
process's resident memory (VmRSS), the window's decode tokens/s and the number of decode steps whose
logits held a NaN or an inf (counted on the device: no extra host sync per step).

A policy whose memory is bounded (streaming, h2o, d2o, tova, simlayerkv's lazy layers, any of them in
KIVI storage) must keep RSS within RSS_TOLERANCE (2%) of its value after the first window, never
produce a non-finite logit, and keep tokens/s flat (the median of the last three windows at least
1 - SPEED_TOLERANCE of the median of windows 2-4).  A failed check is listed in the row's
`soak_failures` and makes the exit status 1.  Append-only policies (full, snapkv, pyramidkv, readers
over them) get a cache of prompt + N slots up front, so their RSS is flat too while their step cost
grows with what they read.

Positions run past the model's context length when prompt + N exceeds it (setup_caches(...,
beyond_context=True): RoPE extrapolates; the logits stay finite, which is what is checked, but text
quality there is not).  The row says so in `beyond_context`.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from bench.measure import release, run_prefill, steps_for, sync, warm_up
from bench.runner import Bench
from bench.specs import CAPACITY_MARGIN, BenchmarkError, Config, build_policy, skip_reason
from runtime.stats import format_bytes
from runtime.steps import run_decode

RSS_TOLERANCE = 0.02      # RSS after the first window must stay within this fraction of it
SPEED_TOLERANCE = 0.25    # the last windows' tokens/s may fall this fraction below the first ones'

# the measured fields of soak rows (null in skipped and error rows)
SOAK_MEASURES = ["policy_config", "soak_windows", "rss_baseline_bytes", "rss_max_drift", "tokens_per_s_first",
                 "tokens_per_s_last", "tokens_per_s_ratio", "nonfinite_steps", "kv_bytes_allocated",
                 "beyond_context", "soak_failures"]


class SoakMode:
    name = "soak"

    def add_arguments(self, parser, exclusive) -> None:
        exclusive.add_argument("--soak", type=int, metavar="STEPS",
                               help="long run: STEPS decode steps per configuration, RSS / tokens/s / NaN-inf "
                                    "checks every --soak-every steps (memory must stay flat under bounded policies)")
        parser.add_argument("--soak-every", type=int, default=500, metavar="STEPS",
                            help="soak: steps per recorded window (default 500)")

    def check(self, o) -> None:
        if o.soak is None:
            return
        if o.soak < 1:
            raise BenchmarkError(f"--soak must be at least 1, got {o.soak}")
        if not 1 <= o.soak_every <= o.soak:
            raise BenchmarkError(f"--soak-every must be in [1, --soak {o.soak}], got {o.soak_every}")

    def selected(self, o) -> bool:
        return o.soak is not None

    def run(self, bench: Bench) -> None:
        o = bench.opts
        for batch in o.batch_list:
            for context in o.context_list:
                tokens = bench.prompt(batch, context)
                for cfg in bench.configs():
                    self.soak_config(bench, cfg, tokens)

    def soak_config(self, bench: Bench, cfg: Config, tokens: torch.Tensor) -> None:
        """One configuration's soak row (skipped / error rows when it cannot run)."""
        batch, context = tokens.shape
        row = bench.base_row(self.name, cfg, batch, context)
        row.update(decode_steps=bench.opts.soak, soak_every=bench.opts.soak_every)
        reason = skip_reason(cfg)
        if reason:
            bench.writer.add(bench.fail_row(row, "skipped", reason, SOAK_MEASURES))
            return
        windows, error = bench.attempt(functools.partial(soak_run, bench, cfg, tokens))
        if error:
            bench.writer.add(bench.fail_row(row, "error", error, SOAK_MEASURES))
            return
        row.update(soak_summary(windows))
        row.update(policy_config=bench.model.cache.describe(), kv_bytes_allocated=bench.model.cache.kv_bytes()["allocated"],
                   beyond_context=context + bench.opts.soak > bench.model.args.max_position_embeddings,
                   status="ok", error=None)
        release(bench.model)
        if row["soak_failures"]:
            bench.errors += 1
        bench.writer.add(row)
        print_soak(row)


def soak_run(bench: Bench, cfg: Config, tokens: torch.Tensor) -> list[dict]:
    """Prefill tokens [B, T], then --soak greedy decode steps -> one dict per window (step, rss_bytes,
    tokens_per_s, nonfinite_steps)."""
    o, model, device = bench.opts, bench.model, bench.device
    prefill, decode = steps_for(cfg, device)
    if cfg.compile:
        warm_up(model, cfg, tokens, o.decode_steps, o.warmup_steps, o.prefill_chunk, bench.meter)
    release(model)
    B, T = tokens.shape
    with torch.inference_mode():
        model.setup_caches(B, T + o.soak + CAPACITY_MARGIN, build_policy(cfg), beyond_context=True)
        token = run_prefill(model, prefill, tokens, o.prefill_chunk).argmax(-1, keepdim=True)
        pos = torch.full((B, 1), T, dtype=torch.long, device=device)
        bad = torch.zeros((), dtype=torch.long, device=device)
        windows, start, t0 = [], 0, time.perf_counter()
        for i in range(o.soak):
            logits = run_decode(model, token, pos, i, decode)
            bad += (~torch.isfinite(logits)).any(-1).sum()
            token, pos = logits.argmax(-1, keepdim=True), pos + 1
            if (i + 1) % o.soak_every == 0 or i + 1 == o.soak:
                sync(device)
                seconds = time.perf_counter() - t0
                windows.append({"step": i + 1, "rss_bytes": bench.meter.current(),
                                "tokens_per_s": B * (i + 1 - start) / seconds, "nonfinite_steps": int(bad)})
                print_window(cfg, windows[-1], o.soak)
                bad.zero_()
                start, t0 = i + 1, time.perf_counter()
    return windows


def soak_summary(windows: list[dict]) -> dict:
    """The row's fields from its windows: RSS drift after the first window, tokens/s of the first
    and last windows (medians of three), non-finite steps, and the failed checks."""
    base = windows[0]["rss_bytes"]
    drift = max((abs(w["rss_bytes"] - base) / base for w in windows[1:]), default=0.0)
    speeds = [w["tokens_per_s"] for w in windows]
    first = statistics.median(speeds[1:4] or speeds)
    last = statistics.median(speeds[-3:])
    nonfinite = sum(w["nonfinite_steps"] for w in windows)
    failures = []
    if drift > RSS_TOLERANCE:
        failures.append(f"RSS moved {100 * drift:.1f}% from its value after step {windows[0]['step']} "
                        f"(limit {100 * RSS_TOLERANCE:.0f}%)")
    if nonfinite:
        failures.append(f"{nonfinite} decode step(s) gave NaN/inf logits")
    if last < (1 - SPEED_TOLERANCE) * first:
        failures.append(f"tokens/s fell from {first:.1f} to {last:.1f} (limit -{100 * SPEED_TOLERANCE:.0f}%)")
    return {"soak_windows": windows, "rss_baseline_bytes": base, "rss_max_drift": drift,
            "tokens_per_s_first": first, "tokens_per_s_last": last, "tokens_per_s_ratio": last / first,
            "nonfinite_steps": nonfinite, "soak_failures": failures}


def print_window(cfg: Config, w: dict, steps: int) -> None:
    print(f"  [soak] {cfg.label} step {w['step']}/{steps}: RSS {format_bytes(w['rss_bytes'])}, "
          f"{w['tokens_per_s']:.2f} tok/s, non-finite steps {w['nonfinite_steps']}", file=sys.stderr, flush=True)


def print_soak(r: dict) -> None:
    """The summary line of a finished soak row."""
    verdict = "; ".join(r["soak_failures"]) or "flat"
    print(f"{r['policy']}{'(' + r['policy_args'] + ')' if r['policy_args'] else ''} kv{r['kv_bits']} "
          f"B={r['batch_size']} ctx={r['context_length']} steps={r['decode_steps']}: RSS "
          f"{format_bytes(r['rss_baseline_bytes'])} (max drift {100 * r['rss_max_drift']:.2f}%), tok/s "
          f"{r['tokens_per_s_first']:.2f} -> {r['tokens_per_s_last']:.2f}, non-finite {r['nonfinite_steps']}: "
          f"{verdict}", flush=True)
