"""--op attention: attention-operator latency only.  Dense SDPA over the whole cache ("dense_sdpa",
the reference) next to each policy's decode attention: its `begin` + `decode` hooks of all layers,
on the q/k/v of a real decode step after a real prefill (HShare's Table 4 shape).

Shapes per layer: q [B, n_heads, 1, head_dim]; k, v [B, n_kv_heads, T, head_dim] (dense_sdpa) or
whatever the policy's `decode` hook receives for one new token.
"""
from __future__ import annotations

import functools
import statistics

import torch

from bench.measure import release, run_prefill, time_calls
from bench.report import print_attention, print_attention_header
from bench.roofline import attention_bound_us
from bench.runner import Bench
from bench.specs import CAPACITY_MARGIN, COMPILES, Config, build_policy, require_positive
from cache import PolicySpec
from model import grouped_attention
from runtime.steps import decode_step, prefill_step

# the measured fields of attention rows (null in skipped and error rows)
ATT_MEASURES = ["policy_config", "n_layers", "attention_us_per_layer", "attention_ms_per_step",
                "attention_us_samples", "kv_bytes_read_per_step", "read_bandwidth_gbs",
                "bandwidth_bound_us_per_layer"]


def dense_step(layers):
    """Dense SDPA of every layer: [(q, k, v)] -> [out [B, n_heads, 1, head_dim]]."""
    return [grouped_attention(q, k, v, None) for q, k, v in layers]


def attention_step(cache, pos, layers, qkv, n_filled):
    """One decode step's attention for every layer: the policy's `begin` + `decode` hooks."""
    cache.begin(pos, n_filled)
    return [cache.decode(layer, q, k, v) for layer, (q, k, v) in zip(layers, qkv)]


@functools.cache
def compiled(step):
    """torch.compile(step, dynamic=True), made once per step function on first use."""
    return torch.compile(step, dynamic=True)


class AttentionMode:
    """--op attention: per (batch, context), the dense_sdpa reference row(s), then one row per
    configuration; latency per layer and per step (all layers), medians of the timed steps."""
    name = "attention"

    def add_arguments(self, parser, exclusive) -> None:
        exclusive.add_argument("--op", choices=["attention"], help="attention-operator latency only")
        parser.add_argument("--op-iters", type=int, default=20, help="--op attention: timed steps per repeat")

    def check(self, o) -> None:
        require_positive(o, "op_iters")

    def selected(self, o) -> bool:
        return bool(o.op)

    def run(self, bench: Bench) -> None:
        o = bench.opts
        print_attention_header()
        for batch in o.batch_list:
            for context in o.context_list:
                for comp in COMPILES[o.compile]:
                    self.dense_row(bench, batch, context, comp)
                tokens = None
                for cfg in bench.configs():
                    problem = bench.cannot_run(cfg, context, 1 + o.op_iters * o.repeats + o.warmup_steps)
                    if problem:
                        bench.writer.add(bench.fail_row(bench.base_row(self.name, cfg, batch, context), *problem,
                                                        ATT_MEASURES))
                        continue
                    tokens = bench.prompt(batch, context) if tokens is None else tokens
                    self.policy_row(bench, cfg, tokens)

    def dense_row(self, bench: Bench, batch: int, context: int, comp: bool) -> None:
        ref = Config(PolicySpec("dense_sdpa"), 16, comp)
        measured, error = bench.attempt(lambda: dense_sdpa_times(bench, batch, context, comp))
        self.add_row(bench, ref, batch, context, measured, error)

    def policy_row(self, bench: Bench, cfg: Config, tokens: torch.Tensor) -> None:
        measured, error = bench.attempt(lambda: policy_attention_times(bench, cfg, tokens))
        self.add_row(bench, cfg, tokens.shape[0], tokens.shape[1], measured, error)

    def add_row(self, bench: Bench, cfg: Config, batch: int, context: int, measured, error) -> None:
        """The row of (step times, n_layers, kv_read, policy_config), or an error row."""
        row = bench.base_row(self.name, cfg, batch, context)
        if error:
            row = bench.fail_row(row, "error", error, ATT_MEASURES)
        else:
            times, n_layers, kv_read, config = measured
            step = statistics.median(times)
            row.update({
                "policy_config": config, "n_layers": n_layers, "iterations": bench.opts.op_iters,
                "attention_us_per_layer": 1e6 * step / n_layers, "attention_ms_per_step": 1e3 * step,
                "attention_us_samples": [1e6 * t / n_layers for t in times],
                "kv_bytes_read_per_step": int(kv_read), "read_bandwidth_gbs": bench.bandwidth_gbs,
                "bandwidth_bound_us_per_layer": attention_bound_us(kv_read, n_layers, bench.bandwidth_gbs),
                "status": "ok", "error": None,
            })
        bench.writer.add(row)
        print_attention(row)


def dense_sdpa_times(bench: Bench, batch: int, context: int, comp: bool):
    """Step times of dense SDPA over random q/k/v of every layer: (times, n_layers, kv_read, config)."""
    a, o = bench.model.args, bench.opts
    g = torch.Generator(device=bench.device).manual_seed(o.seed)
    kw = dict(device=bench.device, dtype=bench.dtype, generator=g)
    layers = [(torch.randn(batch, a.n_heads, 1, a.head_dim, **kw),
               torch.randn(batch, a.n_kv_heads, context, a.head_dim, **kw),
               torch.randn(batch, a.n_kv_heads, context, a.head_dim, **kw)) for _ in range(a.n_layers)]
    step = compiled(dense_step) if comp else dense_step
    with torch.inference_mode():
        times = time_calls(lambda: step(layers), o.op_iters * o.repeats, o.warmup_steps, bench.device)
    kv_read = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _, k, v in layers)
    return times, a.n_layers, kv_read, {"policy": "dense_sdpa"}


def capture_decode_inputs(model, pos: torch.Tensor, logits: torch.Tensor):
    """Run one real decode step after the prefill, recording the (layer, q, k, v) each layer's
    `decode` hook receives: -> [(layer, q, k, v)], copies."""
    cache = model.cache
    captured, real_decode = [], cache.decode

    def recorder(layer, q, k, v):
        captured.append((layer, q.clone(), k.clone(), v.clone()))
        return real_decode(layer, q, k, v)

    cache.decode = recorder
    cache.fused_dense_decode = False            # (a DenseCache's step would otherwise not call decode)
    try:
        decode_step(model, logits.argmax(-1, keepdim=True), pos, cache.n_filled)
    finally:
        del cache.decode, cache.fused_dense_decode
    return captured


def policy_attention_times(bench: Bench, cfg: Config, tokens: torch.Tensor):
    """Prefill tokens [B, T] for real, capture one real decode step's q/k/v, then time `begin` + all
    layers' `decode` on those inputs: (times, n_layers, kv_read, policy_config)."""
    model, o = bench.model, bench.opts
    B, T = tokens.shape
    iters = o.op_iters * o.repeats + o.warmup_steps
    release(model)
    with torch.inference_mode():
        model.setup_caches(B, T + 1 + iters + CAPACITY_MARGIN, build_policy(cfg))
        cache = model.cache
        logits = run_prefill(model, prefill_step, tokens, o.prefill_chunk)
        pos = torch.full((B, 1), T, dtype=torch.long, device=bench.device)
        captured = capture_decode_inputs(model, pos, logits)
        step = compiled(attention_step) if cfg.compile else attention_step
        layers, qkv = [c[0] for c in captured], [c[1:] for c in captured]
        kv_read = cache.kv_bytes()["read_per_step"]
        times = time_calls(lambda: step(cache, pos + 1, layers, qkv, cache.n_filled), o.op_iters * o.repeats,
                           o.warmup_steps, bench.device)
        config = cache.describe()
    release(model)
    return times, len(layers), kv_read, config
