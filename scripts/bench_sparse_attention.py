"""CPU micro-benchmark of the sparse-read kernels (C++ CPU kernels and torch twins) against dense attention.

    OMP_WAIT_POLICY=ACTIVE python scripts/bench_sparse_attention.py [--repeats 30] [--threads N]

One decode step of one layer, fp32, B=8, H_q=9, H_kv=3 (SmolLM2-135M's heads), D=64, S=4096 cached
tokens, N_c in {128, 512}:
  dense          model.grouped_attention(q, k, v, None): SDPA over all S slots
  sparse/kv      sparse_decode_attention's torch twin, one index list per KV head (GQA-shared gather)
  sparse/q       the same with one index list per query head
  ...+ws         the same with a caller-owned workspace dict (gather buffers reused across calls)
  ... cpp        the C++ CPU kernel (kernels/cpu.py: selected rows read in place), when it builds
  gather         the two index_select gathers of sparse/kv alone
  scores C=..    approx_scores (group="kv", sink/recent masking fused) + torch.topk(N_c), fp32 labels
  scores4 C=..   the same from 4-bit packed labels
  topk / select  top-N_c of the masked scores alone: torch.topk, and the C++ radix select
  ds step        scores4 C=16 + sparse/kv+ws: a whole Double-Sparsity decode attention (twins);
                 "ds step cpp": the same with the C++ select and attention
Repetitions are interleaved (round r times every op once; each sample is the mean of --inner calls)
and medians are printed with the ratio dense / op (> 1: faster than dense).

CPU: set OMP_WAIT_POLICY=ACTIVE (PyTorch's OpenMP workers then spin between the many small ops
instead of sleeping); on a shared machine the numbers are only as quiet as the neighbours.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels import (approx_scores, quantize_labels_4bit, select_critical,  # noqa: E402
                     sparse_decode_attention)
from kernels.cpu import cpu_kernels_available, select_top_cpu  # noqa: E402
from kernels.sparse_attention import _gather  # noqa: E402
from model import grouped_attention  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--n-critical", default="128,512")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--inner", type=int, default=5, help="calls averaged per sample")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd twins (slow to compile)")
    return p.parse_args(argv)


def attention_ops(ops: dict, q, k, v, n: int, g, compile: bool) -> dict:
    """Sparse attention over n random slots per list (GQA-shared and per query head): twin, twin with a
    workspace, C++, the gather alone, and the compiled twin.  Returns the workspace the twin fills."""
    B, Hq, Hkv, S = q.shape[0], q.shape[1], k.shape[1], k.shape[2]
    idx_kv = torch.stack([torch.randperm(S, generator=g)[:n] for _ in range(B * Hkv)]).view(B, Hkv, n)
    idx_q = torch.stack([torch.randperm(S, generator=g)[:n] for _ in range(B * Hq)]).view(B, Hq, n)
    twin, ws = dict(backend="torch"), {}
    ops[f"sparse/kv N={n}"] = lambda i=idx_kv: sparse_decode_attention(q, k, v, i, **twin)
    ops[f"sparse/q N={n}"] = lambda i=idx_q: sparse_decode_attention(q, k, v, i, **twin)
    ops[f"sparse/kv+ws N={n}"] = lambda i=idx_kv: sparse_decode_attention(q, k, v, i, workspace=ws, **twin)
    ops[f"sparse/q+ws N={n}"] = lambda i=idx_q: sparse_decode_attention(q, k, v, i, workspace=ws, **twin)
    if cpu_kernels_available():
        ops[f"sparse/kv cpp N={n}"] = lambda i=idx_kv: sparse_decode_attention(q, k, v, i, backend="cpp")
        ops[f"sparse/q cpp N={n}"] = lambda i=idx_q: sparse_decode_attention(q, k, v, i, backend="cpp")
    ops[f"gather N={n}"] = lambda i=idx_kv: (_gather(k, i), _gather(v, i))
    if compile:
        from kernels import sparse_decode_attention_torch
        comp = torch.compile(sparse_decode_attention_torch, dynamic=False)
        ops[f"sparse/kv compiled N={n}"] = lambda i=idx_kv: comp(q, k, v, i)
    return ws


def selection_ops(ops: dict, q, k, v, labels: dict, n: int, ws: dict) -> None:
    """Approximate scores + top-n (float and 4-bit labels, C 8 and 16), torch.topk vs the radix select,
    and a whole Double Sparsity step (scores, select, sparse attention)."""
    B, S = k.shape[0], k.shape[2]
    x, y = (8, 32) if n <= 128 else (16, 64)
    length = torch.full((B,), S)
    cpp = cpu_kernels_available()
    for C, (ql, lab, (pk, sc, mn)) in labels.items():
        ops[f"scores C={C} N={n}"] = lambda ql=ql, lab=lab: select_critical(
            approx_scores(ql, lab, length=length, n_sink=x, n_recent=y), n)
        ops[f"scores4 C={C} N={n}"] = lambda ql=ql, pk=pk, sc=sc, mn=mn: select_critical(
            approx_scores(ql, pk, sc, mn, length=length, n_sink=x, n_recent=y), n)
    ql, lab, (pk, sc, mn) = labels[16]
    masked = approx_scores(ql, lab, length=length, n_sink=x, n_recent=y)
    no_bias = torch.zeros(B, 1, S + n)
    ops[f"topk N={n}"] = lambda: torch.topk(masked, n, dim=-1, sorted=False)
    if cpp:
        ops[f"select cpp N={n}"] = lambda: select_top_cpu(masked, no_bias, n)

    def ds_step():
        idx = select_critical(approx_scores(ql, pk, sc, mn, length=length, n_sink=x, n_recent=y), n)
        return sparse_decode_attention(q, k, v, idx, workspace=ws, backend="torch")

    def ds_step_cpp():
        idx, ok = select_top_cpu(approx_scores(ql, pk, sc, mn, length=length, n_sink=x, n_recent=y), no_bias, n)
        return sparse_decode_attention(q, k, v, idx, ok, backend="cpp")
    ops[f"ds step C=16/4b N={n}"] = ds_step
    if cpp:
        ops[f"ds step cpp N={n}"] = ds_step_cpp


def time_ops(ops: dict, repeats: int, inner: int) -> dict:
    """Per op, `repeats` samples of the mean time of `inner` calls, interleaved across ops, after 3 warm-up calls."""
    for f in ops.values():   # warm-up (and compilation)
        for _ in range(3):
            f()
    samples = {name: [] for name in ops}
    for _ in range(repeats):
        for name, f in ops.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            samples[name].append((time.perf_counter() - t0) / inner)
    return samples


def main(argv=None):
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, Hq, Hkv, D, S = args.batch, 9, 3, 64, args.seq
    print(f"torch {torch.__version__}  threads={torch.get_num_threads()}  "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}  "
          f"loadavg={os.getloadavg()[0]:.2f}  B={B} H_q={Hq} H_kv={Hkv} D={D} S={S} fp32")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    ops = {"dense": lambda: grouped_attention(q[:, :, None], k, v, None)}
    labels = {}
    for C in (8, 16):
        lab = torch.randn(B, Hkv, S, C, generator=g)
        labels[C] = (torch.randn(B, Hq, C, generator=g), lab, quantize_labels_4bit(lab))
    for n in [int(x) for x in args.n_critical.split(",")]:
        ws = attention_ops(ops, q, k, v, n, g, args.compile)
        selection_ops(ops, q, k, v, labels, n, ws)
    samples = time_ops(ops, args.repeats, args.inner)
    med = {name: statistics.median(s) for name, s in samples.items()}
    print(f"{'op':<24}{'median us':>12}{'dense/op':>10}{'  (p25-p75 us)':>20}")
    for name, s in samples.items():
        qs = statistics.quantiles(s, n=4)
        print(f"{name:<24}{med[name] * 1e6:>12.1f}{med['dense'] / med[name]:>10.2f}"
              f"   ({qs[0] * 1e6:.0f}-{qs[2] * 1e6:.0f})")
    print(f"loadavg at end {os.getloadavg()[0]:.2f}")
    return med


if __name__ == "__main__":
    main()
