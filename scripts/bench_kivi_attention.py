"""CPU micro-benchmark of kvc::kivi_attention (decode attention over KIVI-packed storage) against the
same attention over fp32 storage, in one process, each op's rate beside the machine's measured FMA peak
and memory read rate.

    OMP_WAIT_POLICY=ACTIVE python scripts/bench_kivi_attention.py [--baseline REV] [--repeats 30]
    OMP_WAIT_POLICY=ACTIVE python scripts/bench_kivi_attention.py --n-critical 0     # the dense path

Sparse (default): one decode attention as `ds` issues it: B=8, H_q=9, H_kv=3, D=64, S=4096 cached
tokens, lists per KV head of N_c=512 slots (16 sinks, the 64 newest, 432 others drawn at random),
ascending as kvc::select_top returns them.  Dense (--n-critical 0): every slot, as `full` reads it.
KIVI storage at G=32, R=128, 4 and 2 bits.  Each op cycles over --layers caches (8: no cache's lines
stay in the 32 MiB L3 between its calls, as in a model's decode step).
  fp32           kvc::sparse_attention (dense: kvc::dense_attention) over k, v [B, H_kv, S, D] fp32
  fp32 lanes8    (dense) the same op in 8-lane vectors: the AVX2 path, forced on an AVX-512 CPU
  kivi4 / kivi2  kvc::kivi_attention (this checkout's build) over the packed storage, fp32 arithmetic
  kivi4 vnni ... the same op in integer arithmetic (dense only; kernels/kivi_int.py's scheme): "vnni"
                 (AVX-512 VNNI) or "avx2" as this CPU has; --arith avx2 forces the AVX2 path on a VNNI CPU
  kivi4 slots    (sparse) the same op over the slot-major copy of the words the readers keep
                 (SlotStore.keep_slot_major / reader_buffers)
  ... REV        the same op built from kernels/kivi_kernels.cpp and cpu_kernels.cpp (with their
                 headers) at git revision REV (--baseline), registered as kvc_old:: so that both run side by side
Rounds are interleaved (round r times every op once; a sample is the mean of --inner calls); medians
(and minima) in microseconds, the ratio fp32 / op (> 1: faster than fp32 storage), and the rate of
query x key and weight x value multiply-adds (G MAC/s: 2 B H_q N D per call, N = S when dense) beside the
measured fp32 FMA peak of the same threads: the fastest of max(3, --repeats / 5) 2048 x 2048 x 2048 fp32
matmuls (torch.mm, oneDNN/MKL; --peak-size), 2048^3 multiply-adds each; and the rate the op reads its
storage at (GB/s: the bytes of the K/V rows or packed buffers it reads per call; sparse: the selected
rows' share) beside the measured read rate of memory: the fastest torch.sum over a 512 MiB fp32 tensor
(--read-mib), on the same threads.  An op whose bytes per multiply-add exceed peak read rate / FMA
peak cannot reach the FMA peak: the last column is its bound, min(FMA peak, read rate x MACs / bytes).
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import cycle
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from cache.quantized import SlotStore  # noqa: E402
from kernels.cpu import ARITH, cpu_kernels_available, kivi_int_arith, kivi_write_range_cpu  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--n-critical", type=int, default=512, help="selected slots per KV head; 0: the dense path")
    p.add_argument("--bits", default="4,2")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--inner", type=int, default=5, help="calls averaged per sample")
    p.add_argument("--layers", type=int, default=8,
                   help="distinct caches cycled through (as the model's layers: none stays in L3)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--baseline", default=None, help="git revision whose kivi_kernels.cpp to time as well")
    p.add_argument("--arith", default="int", choices=["int", "avx2", "vnni"],
                   help="the integer rows' arithmetic (int: the best this CPU has)")
    p.add_argument("--peak-size", type=int, default=2048, help="the FMA peak's matmul size")
    p.add_argument("--read-mib", type=int, default=512, help="the read rate's tensor size (MiB)")
    return p.parse_args(argv)


def build_baseline(rev: str) -> None:
    """kernels/kivi_kernels.cpp and cpu_kernels.cpp at `rev` (with that revision's cpu_vec.h), their ops
    registered under kvc_old::."""
    def show(name):
        return subprocess.run(["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
    rev_hash = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"kvc_kernels_{rev_hash}"
    folder.mkdir(exist_ok=True)
    (folder / "cpu_vec.h").write_text(show("cpu_vec.h"))
    sources = []
    for name in ("kivi_kernels.cpp", "cpu_kernels.cpp"):
        src = show(name)
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
            src = src.replace(f"{macro}(kvc,", f"{macro}(kvc_old,")
        (folder / name).write_text(src)
        sources.append(str(folder / name))
    from torch.utils.cpp_extension import load
    load(name=f"kvc_old_{rev_hash}", sources=sources, extra_include_paths=[str(folder)],
         extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=False, verbose=False)


def fma_peak(size: int, repeats: int) -> float:
    """The fp32 multiply-add rate (G MAC/s) of a size^3 matmul on torch's threads, best of `repeats`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(max(3, repeats // 5)))
    return size ** 3 / best / 1e9


def read_rate(mib: int, repeats: int) -> float:
    """Memory's read rate (GB/s) on torch's threads: the fastest torch.sum over mib MiB of fp32."""
    x = torch.ones(mib * 2 ** 18)
    x.sum()
    best = min(_timed(x.sum) for _ in range(max(3, repeats // 5)))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rotate(calls):
    """A function calling the next of calls [(op, args)] in turn (the next layer's cache)."""
    it = cycle(calls)

    def call():
        op, a = next(it)
        return op(*a)
    return call


def fp32_calls(layers, q, idx, valid, S, scale, baseline):
    """{name: [(op, args) per layer]}: the fp32 op over each layer's k, v: kvc::dense_attention when idx is
    empty (also in 8 lanes, the AVX2 path), else kvc::sparse_attention; and the same ops of --baseline."""
    ns = [torch.ops.kvc] + ([torch.ops.kvc_old] if baseline else [])
    calls = {}
    for ns_, tag in zip(ns, ["", f" {baseline}"]):
        if idx.numel() == 0:
            calls["fp32" + tag] = [(ns_.dense_attention, (q, k, v, S, scale)) for k, v in layers]
            if not tag:
                calls["fp32 lanes8"] = [(ns_.dense_attention, (q, k, v, S, scale, 8)) for k, v in layers]
        else:
            calls["fp32" + tag] = [(ns_.sparse_attention, (q, k, v, idx, valid, scale)) for k, v in layers]
    return calls


def index_lists(B, H, S, N, g):
    """[B, H, N] ascending: 16 sinks, the 64 newest slots and N - 80 others at random."""
    rows = []
    for _ in range(B * H):
        middle = torch.randperm(S - 80, generator=g)[:N - 80] + 16
        rows.append(torch.cat([torch.arange(16), middle, torch.arange(S - 64, S)]).sort().values)
    return torch.stack(rows).view(B, H, N)


def main(argv=None):
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels_available():
        sys.exit("the C++ CPU kernels did not build")
    if args.baseline:
        build_baseline(args.baseline)
    B, H, Hq, D, S, N, G, R = args.batch, 3, 9, 64, args.seq, args.n_critical, 32, 128
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g))
              for _ in range(args.layers)]
    q = torch.randn(B, Hq, D, generator=g)
    idx = index_lists(B, H, S, N, g) if N else None
    valid = torch.ones(B, H, N, dtype=torch.bool)
    pos = torch.arange(S).expand(B, 1, S).contiguous()
    now = torch.full((B,), S - 1)
    scale = D ** -0.5
    empty_b = torch.empty(0, 0, 0, dtype=torch.bool)
    dense = N == 0
    arith = kivi_int_arith() if args.arith == "int" else args.arith
    share = (N or S) / S                                            # of the storage a call reads
    if dense:
        idx, valid = torch.empty(0, dtype=torch.long), empty_b
    calls = fp32_calls(layers, q, idx, valid, S, scale, args.baseline)
    nbytes = {name: 2 * B * H * S * D * 4 * share for name in calls}
    for bits in (int(b) for b in args.bits.split(",")):
        stores, slot_major = [], []
        for k, v in layers:
            store = SlotStore(B, H, D, S + G, bits, G, R, torch.float32)
            kivi_write_range_cpu(store.buffers, 0, k, v, pos, now)
            stores.append((q, *store.buffers[:8], pos, empty_b, now, idx, valid, S, bits, G, scale))
            if not dense:
                store.keep_slot_major()
                slot_major.append((q, *store.reader_buffers[:8], pos, empty_b, now, idx, valid, S, bits, G, scale))
        read = sum(t.nbytes for t in stores[0][1:9]) * share
        calls[f"kivi{bits}"] = [(torch.ops.kvc.kivi_attention, c) for c in stores]
        if slot_major:
            calls[f"kivi{bits} slots"] = [(torch.ops.kvc.kivi_attention, c) for c in slot_major]
        if dense and arith != "fp32" and bits in (2, 4):
            calls[f"kivi{bits} {arith}"] = [(torch.ops.kvc.kivi_attention, (*c, ARITH[arith])) for c in stores]
        if args.baseline:
            calls[f"kivi{bits} {args.baseline}"] = [(torch.ops.kvc_old.kivi_attention, c) for c in stores]
            torch.testing.assert_close(torch.ops.kvc.kivi_attention(*stores[0]),
                                       torch.ops.kvc_old.kivi_attention(*stores[0]), atol=1e-4, rtol=1e-4)
        nbytes.update({name: read for name in calls if name not in nbytes})
    ops = {name: rotate(cl) for name, cl in calls.items()}
    times = {name: [] for name in ops}
    for name, op in ops.items():
        for _ in range(args.layers):
            op()
    for _ in range(args.repeats):
        for name, op in ops.items():
            t0 = time.perf_counter()
            for _ in range(args.inner):
                op()
            times[name].append((time.perf_counter() - t0) / args.inner * 1e6)
    base = statistics.median(times["fp32"])
    macs = 2 * B * Hq * (N or S) * D
    peak, bandwidth = fma_peak(args.peak_size, args.repeats), read_rate(args.read_mib, args.repeats)
    print(f"B={B} Hq={Hq} Hkv={H} D={D} S={S} N={N or 'all'} G={G} R={R} threads={torch.get_num_threads()}  "
          f"FMA peak {peak:.1f} G MAC/s (fp32 matmul {args.peak_size}^3)  read rate {bandwidth:.1f} GB/s "
          f"(sum over {args.read_mib} MiB)")
    for name, ts in times.items():
        med = statistics.median(ts)
        rate, gbs = macs / med / 1e3, nbytes[name] / med / 1e3
        bound = min(peak, bandwidth * macs / nbytes[name])
        print(f"{name:>16}: {med:8.1f} us (min {min(ts):8.1f})   fp32/op {base / med:5.2f}   "
              f"{rate:6.1f} G MAC/s = {100 * rate / peak:5.1f}% of peak   {gbs:6.1f} GB/s = "
              f"{100 * gbs / bandwidth:5.1f}% of read rate   bound {bound:6.1f} G MAC/s")


if __name__ == "__main__":
    main()
