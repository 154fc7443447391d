"""CPU benchmark: decode attention over a 16-bit cache vs a 4-bit KIVI cache (quantize.QuantizedKV).

    OMP_WAIT_POLICY=ACTIVE python scripts/bench_quantize.py [--layers 30] [--repeats 7] [--compile]

One decode step, B=8, H_q=9, H_kv=3, D=64 (SmolLM2-135M's heads), T=4096 cached tokens, timed over
--layers separate caches (one per layer, as in the model) so that no variant runs out of the L3
cache unless the whole model's cache would fit there.  Variants:
  fp32 sdpa      model.grouped_attention (SDPA) over the fp32 cache: what the engine runs today
  bf16 / fp16    the same over a 16-bit cache (q in the same dtype)
  bf16 mm        q @ k^T -> fp32 softmax -> p @ v over the bf16 cache (the fastest eager 16-bit path here)
  kivi4          QuantizedKV(bits=4, G=32, R=32).attend over the same tokens (torch twin, eager)
  --compile adds torch.compile'd fp32/bf16 SDPA, bf16 mm and kivi4 (dynamic=False); compiled,
  kivi4's attention is one fused Inductor loop nest over the packed words (see
  kernels/quantized_attention.py), the only CPU path here that reads fewer bytes *and* is not
  dominated by unpacking overhead.
Repetitions are interleaved (each round times every variant once, a sample = mean ms per layer over
all layers); medians are printed with bytes read per layer, the effective GB/s, and speed-ups
(vs fp32 SDPA, and vs the fastest 16-bit variant of the run, eager or compiled).
OMP_WAIT_POLICY must be set before torch starts (this script sets ACTIVE unless already set).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import grouped_attention  # noqa: E402
from quantize import QuantizedKV  # noqa: E402


def dense_mm(q, k, v):
    """q [B, Hq, 1, D] -> [B, Hq, 1, D]: two batched GEMVs in the cache dtype, softmax in fp32."""
    B, Hq, _, D = q.shape
    H = k.shape[1]
    qg = q.view(B, H, Hq // H, D)
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * D ** -0.5
    return torch.matmul(s.softmax(-1).to(v.dtype), v).view(B, Hq, 1, D)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, Hq, H, D, T, L = args.batch, 9, 3, 64, args.seq, args.layers
    print(f"torch {torch.__version__}  threads={torch.get_num_threads()}  "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}  loadavg={os.getloadavg()[0]:.2f}  "
          f"B={B} H_q={Hq} H_kv={H} D={D} T={T} layers={L}", flush=True)
    g = torch.Generator().manual_seed(0)
    caches = {"fp32": [], "bf16": [], "fp16": []}
    quant = []
    for _ in range(L):
        k = torch.randn(B, H, T, D, generator=g)
        v = torch.randn(B, H, T, D, generator=g)
        caches["fp32"].append((k, v))
        caches["bf16"].append((k.bfloat16(), v.bfloat16()))
        caches["fp16"].append((k.half(), v.half()))
        kv = QuantizedKV(B, H, D, T, bits=args.bits, group=32, residual=32, dtype=torch.float32)
        kv.append_prefill(k, v)
        quant.append(kv)
    q = torch.randn(B, Hq, 1, D, generator=g)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    qs = {name: q.to(dtypes[name]) for name in caches}

    def dense(name, fn=grouped_attention):
        cs, qq = caches[name], qs[name]
        return lambda i: fn(qq, cs[i][0], cs[i][1], None)

    variants = {
        "fp32 sdpa": (dense("fp32"), caches["fp32"][0][0].nbytes * 2),
        "bf16 sdpa": (dense("bf16"), caches["bf16"][0][0].nbytes * 2),
        "fp16 sdpa": (dense("fp16"), caches["fp16"][0][0].nbytes * 2),
        "bf16 mm": (dense("bf16", lambda qq, k, v, m: dense_mm(qq, k, v)), caches["bf16"][0][0].nbytes * 2),
        f"kivi{args.bits}": (lambda i: quant[i].attend(q), quant[0].nbytes(live=True)),
    }
    if args.compile:
        sdpa_c = torch.compile(grouped_attention, dynamic=False)
        attend_c = torch.compile(QuantizedKV.attend, dynamic=False)
        variants["fp32 sdpa compiled"] = (dense("fp32", sdpa_c), variants["fp32 sdpa"][1])
        variants["bf16 sdpa compiled"] = (dense("bf16", sdpa_c), variants["bf16 sdpa"][1])
        mm_c = torch.compile(dense_mm, dynamic=False)
        variants["bf16 mm compiled"] = (dense("bf16", lambda qq, k, v, m: mm_c(qq, k, v)), variants["bf16 mm"][1])
        variants[f"kivi{args.bits} compiled"] = (lambda i: attend_c(quant[i], q), quant[0].nbytes(live=True))
    ref = grouped_attention(q, *caches["fp32"][0], None)
    for name, (fn, _) in variants.items():   # warm up (and compile), check against fp32
        t0 = time.perf_counter()
        err = (fn(0).float() - ref).abs().max().item()
        print(f"  warm-up {name:<22} {time.perf_counter() - t0:7.1f} s   max |out - fp32 sdpa| = {err:.2e}",
              flush=True)
    samples = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (fn, _) in variants.items():
            t0 = time.perf_counter()
            for i in range(L):
                fn(i)
            samples[name].append((time.perf_counter() - t0) / L * 1e3)
    med = {name: statistics.median(s) for name, s in samples.items()}
    base16 = min(ms for name, ms in med.items() if name.startswith(("bf16", "fp16")))
    print(f"\n{'variant':<22} {'ms/layer':>9} {'MB read':>8} {'GB/s':>6} {'vs fp32 sdpa':>13} "
          f"{'vs best 16-bit':>15}   (median of {args.repeats}, loadavg {os.getloadavg()[0]:.2f})")
    for name, (_, nbytes) in variants.items():
        ms = med[name]
        print(f"{name:<22} {ms:9.2f} {nbytes / 1e6:8.1f} {nbytes / ms / 1e6:6.1f} "
              f"{med['fp32 sdpa'] / ms:12.2f}x {base16 / ms:14.2f}x")


if __name__ == "__main__":
    main()
