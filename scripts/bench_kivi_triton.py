"""The KIVI decode-attention Triton kernels on a CUDA GPU: the fp32-arithmetic kernel (kernels/kivi_triton.py)
and the integer one (kernels/kivi_int_triton.py) over the same 2/4-bit storage, beside bf16 SDPA over as
many unpacked tokens; each kernel's largest error against its torch twin.

    python scripts/bench_kivi_triton.py [--batch 8] [--seq 4096] [--bits 4,2]

Shapes: the default model's attention (9 query heads, 3 KV heads, head_dim 64), KIVI's G 32 / R 128,
random keys and values written through the store's torch path.  Times: triton.testing.do_bench (the
median over CUDA events).  Without CUDA it exits 2 with a one-line message (on CPU the kernels are
checked under TRITON_INTERPRET=1 by tests/test_kivi_int_triton.py and tests/test_kivi_kernels.py).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache.quantized import SlotStore  # noqa: E402
from kernels.kivi_attention import kivi_attention_torch  # noqa: E402
from kernels.kivi_int import kivi_attention_int_triton_torch  # noqa: E402

H_Q, H_KV, D, GROUP, RESIDUAL = 9, 3, 64, 32, 128


def store(batch: int, n: int, bits: int, g: torch.Generator):
    """A store holding n random tokens (positions 0..n-1) -> (store, pos [B, H, C], now [B])."""
    s = SlotStore(batch, H_KV, D, n, bits, GROUP, RESIDUAL, torch.float32, device="cuda")
    pos = torch.full((batch, H_KV, s.k_scale.shape[2] * GROUP), -1, device="cuda")
    pos[..., :n] = torch.arange(n, device="cuda")
    k = torch.randn(batch, H_KV, n, D, device="cuda", generator=g) * 2 + 0.3
    v = torch.randn(batch, H_KV, n, D, device="cuda", generator=g)
    now = torch.full((batch,), n - 1, device="cuda")
    s.write_range_torch(0, k, v, pos, now)
    return s, pos, now


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--bits", default="4,2")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_kivi_triton.py times the Triton kernels on a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    from triton.testing import do_bench
    from kernels.kivi_int_triton import kivi_attention_int_triton
    from kernels.kivi_triton import kivi_attention_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    B, n = a.batch, a.seq
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B {B}, {n} tokens, {H_Q} query / {H_KV} KV "
          f"heads, head_dim {D}, G {GROUP}, R {RESIDUAL}")
    for bits in (int(b) for b in a.bits.split(",")):
        s, pos, now = store(B, n, bits, g)
        q = torch.randn(B, H_Q, 1, D, device="cuda", generator=g)
        buf, args = s.buffers, (pos, None, now, n)
        fp32 = lambda: kivi_attention_triton(q, buf, *args)  # noqa: E731
        integer = lambda: kivi_attention_int_triton(q, buf, *args)  # noqa: E731
        e_fp32 = (fp32() - kivi_attention_torch(q, buf, *args)).abs().max().item()
        e_int = (integer() - kivi_attention_int_triton_torch(q, buf, *args)).abs().max().item()
        t_fp32, t_int = do_bench(fp32, warmup=50, rep=300), do_bench(integer, warmup=50, rep=300)
        mib = sum(t.numel() * t.element_size() for t in buf[:6]) / 2 ** 20
        print(f"{bits}-bit: fp32-arithmetic kernel {t_fp32 * 1e3:.1f} us (max |err| {e_fp32:.1e}), integer kernel "
              f"{t_int * 1e3:.1f} us (max |err| {e_int:.1e}): {t_fp32 / t_int:.2f}x; {mib:.1f} MiB packed")
    k = torch.randn(B, H_KV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v, qb = torch.randn_like(k), torch.randn(B, H_Q, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qb, k, v, enable_gqa=True)  # noqa: E731
    print(f"bf16 SDPA over {n} unpacked tokens: {do_bench(sdpa, warmup=50, rep=300) * 1e3:.1f} us "
          f"({2 * k.numel() * 2 / 2 ** 20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
