"""Integer KIVI attention (kernels/kivi_int.py's scheme): kvc::kivi_attention's integer dense path on both
ISAs' code (an AVX-512 VNNI CPU builds and runs the AVX2 path too; an AVX2-only CPU runs its own) against
the integer twin over every group boundary, odd lengths, every key-residual size and the value chunks, 2
and 4 bits; the twin's fp32 helpers against their definitions; the integer twin near the fp32 twin (the
measured bound); the KVC_KIVI_ARITH switch."""
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import needs_cpp  # noqa: E402
from tests.test_kivi_kernels import dense_cases, random_store  # noqa: E402

from cache.quantized import SlotStore  # noqa: E402

import kernels.cpu as cpu  # noqa: E402
from kernels.kivi_attention import kivi_attention, kivi_attention_torch, ring_flags  # noqa: E402
from kernels.kivi_int import kivi_attention_int_torch, kivi_attention_int_triton_torch, lane_dot, vexp  # noqa: E402
from model import grouped_attention  # noqa: E402

ARITHS = ["vnni", "avx2"]
CASES = [(bits, D, G, R) for bits in (4, 2)
         for D, G, R in ((64, 32, 128), (64, 16, 32), (128, 32, 64), (128, 16, 32), (64, 64, 64), (128, 128, 128))]


def run_int(arith, q, store, pos, visible, now, n):
    """The kernel in `arith`, skipped where this CPU's build lacks it."""
    have = cpu.kivi_int_arith()
    if not (arith == have or (arith == "avx2" and have == "vnni")):
        pytest.skip(f"{arith} is not built on this CPU (best: {have})")
    return cpu.kivi_attention_cpu(q, store.buffers, pos, visible, now, n, arith=arith)


@needs_cpp
@pytest.mark.parametrize("arith", ARITHS)
@pytest.mark.parametrize("bits,D,G,R", CASES)
def test_int_kernel_equals_int_twin(arith, bits, D, G, R):
    """Dense reads (tests/test_kivi_kernels.py's dense_cases: lengths 1 .. 257 across every group boundary,
    odd ones too, GQA and MHA, per-head or shared visibility, shuffled slots): kernel == twin within 1e-4."""
    for q, store, pos, visible, now, n in dense_cases(bits, D, G, R):
        ref = kivi_attention_int_torch(q, store.buffers, pos, visible, now, n)
        torch.testing.assert_close(run_int(arith, q, store, pos, visible, now, n), ref, atol=1e-4, rtol=1e-4)


@needs_cpp
@pytest.mark.parametrize("arith", ARITHS)
@pytest.mark.parametrize("bits", [4, 2])
def test_int_kernel_every_residual_size(arith, bits):
    """n through a whole R-block: the key residual takes every size 0 .. R-1 (exact ring keys in the max)."""
    R, sizes = 32, set()
    for n in range(4 * R, 5 * R):
        store, pos, now, g = random_store(2, 3, 64, n, bits, 16, R, seed=n, evict=True)
        q = torch.randn(2, 9, 1, 64, generator=g)
        sizes.add(int(ring_flags(pos, now, R)[0][1, 0].sum()))
        ref = kivi_attention_int_torch(q, store.buffers, pos, pos >= 0, now, n)
        torch.testing.assert_close(run_int(arith, q, store, pos, pos >= 0, now, n), ref, atol=1e-4, rtol=1e-4)
    assert sizes == set(range(R))


@needs_cpp
@pytest.mark.parametrize("arith", ARITHS)
@pytest.mark.parametrize("bits,D,G", [(4, 64, 32), (2, 128, 16), (4, 128, 64), (2, 64, 32)])
def test_int_kernel_value_chunk_boundaries(arith, bits, D, G):
    """Lengths around the integer path's value chunks (256 slots) and score blocks (32)."""
    for i, n in enumerate((255, 256, 257, 511, 528, 1041)):
        store, pos, now, g = random_store(2, 3, D, n, bits, G, 64, seed=40 + i, evict=i % 2 == 1)
        q = torch.randn(2, 9, 1, D, generator=g) * 2
        vis = (pos >= 0) & (torch.rand(2, 3, pos.shape[2], generator=g) > 0.1)
        ref = kivi_attention_int_torch(q, store.buffers, pos, vis, now, n)
        torch.testing.assert_close(run_int(arith, q, store, pos, vis, now, n), ref, atol=1e-4, rtol=1e-4)


@needs_cpp
@pytest.mark.parametrize("arith", ["vnni", "avx2", "fp32"])
@pytest.mark.parametrize("bits,D,G", [(4, 64, 32), (2, 128, 16), (4, 128, 64), (2, 64, 32)])
def test_split_dense_reads_equal_twins(arith, bits, D, G):
    """Lists that do not divide evenly over the threads (1 x 3 KV heads on 2 threads, 1 x 1 on 3) are read in
    256-slot chunks merged by log-sum-exp: equal to the twins (integer and fp32 arithmetic) within 1e-4,
    lengths around the spans, ring slots and hidden slots spread over the chunks (shuffled slots); a chunk
    with nothing visible (a hidden span) and a list with nothing visible read as an unsplit read (zeros)."""
    twin = kivi_attention_torch if arith == "fp32" else kivi_attention_int_torch
    threads = torch.get_num_threads()
    try:
        for i, (B, H, t, n) in enumerate(((1, 3, 2, 700), (1, 3, 2, 1024), (1, 1, 3, 1041), (1, 3, 2, 2305))):
            torch.set_num_threads(t)
            store, pos, now, g = random_store(B, H, D, n, bits, G, 64, seed=70 + i, evict=i % 2 == 0)
            q = torch.randn(B, 3 * H, 1, D, generator=g) * 2
            vis = (pos >= 0) & (torch.rand(B, H, pos.shape[2], generator=g) > 0.1)
            vis[..., 256:512] = False                                           # a span hidden in every list
            vis[0, 0] = False if i == 3 else vis[0, 0]                          # a list seeing nothing
            ref = twin(q, store.buffers, pos, vis, now, n)
            out = (cpu.kivi_attention_cpu(q, store.buffers, pos, vis, now, n, arith="fp32") if arith == "fp32"
                   else run_int(arith, q, store, pos, vis, now, n))
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            if i == 3:
                assert out[0, :3].abs().max() == 0
    finally:
        torch.set_num_threads(threads)


@needs_cpp
@pytest.mark.parametrize("arith", ["vnni", "avx2", "fp32"])
@pytest.mark.parametrize("bits", [4, 2])
def test_hidden_slots_do_not_set_the_maximum(arith, bits):
    """Hidden slots whose keys score far above every visible one (~ +900 against a few units): the row
    maximum comes from the visible scores after masking (and the exact ring keys), not from the packed
    scores before it, else every visible weight exp(s - m) underflows to 0."""
    B, H, D, G, R, n = 2, 3, 64, 32, 64, 600
    g = torch.Generator().manual_seed(5)
    store = SlotStore(B, H, D, n + 2 * G, bits, G, R, torch.float32)
    pos = torch.full((B, H, n + 2 * G), -1)
    pos[..., :n] = torch.arange(n)
    u = torch.randn(B, H, 1, D, generator=g)
    k = torch.randn(B, H, n, D, generator=g) * 2 + 0.3
    hidden = torch.zeros(n, dtype=torch.bool)
    hidden[3:n - R:7] = True                                 # outside the ring: their scores are packed
    k[:, :, hidden] = 30 * u
    now = torch.full((B,), n - 1)
    store.write_range_torch(0, k, torch.randn(B, H, n, D, generator=g), pos[..., :n], now)
    q = u.repeat_interleave(3, dim=1) * 2                   # every query row along the hidden keys
    vis = pos >= 0
    vis[..., :n] &= ~hidden
    twin = kivi_attention_torch if arith == "fp32" else kivi_attention_int_torch
    ref = twin(q, store.buffers, pos, vis, now, n)
    out = (cpu.kivi_attention_cpu(q, store.buffers, pos, vis, now, n, arith="fp32") if arith == "fp32"
           else run_int(arith, q, store, pos, vis, now, n))
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_twin_helpers_match_their_definitions():
    """vexp: cpu_vec.h's polynomial (relative error < 2e-7 of exp, 0 below -87.3); lane_dot: a dot product."""
    x = torch.cat([torch.linspace(-87, 0, 10001), torch.tensor([-math.inf, -100.0, -87.31])])
    e = vexp(x)
    torch.testing.assert_close(e[:-3], torch.exp(x[:-3].double()).float(), atol=0, rtol=3e-7)
    assert torch.equal(e[-3:], torch.zeros(3))
    a, b = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lane_dot(a, b), (a.double() * b.double()).sum(-1).float(), atol=1e-5, rtol=1e-5)


INT_VS_KIVI = 0.5       # measured 0.14-0.21 at 4 bits, 0.03-0.04 at 2 bits (kernels/kivi_int.py)


@pytest.mark.parametrize("twin", [kivi_attention_int_torch, kivi_attention_int_triton_torch], ids=["cpu", "triton"])
@pytest.mark.parametrize("bits", [4, 2])
def test_int_twin_near_fp32_twin(bits, twin):
    """The integer scheme (the C++ op's twin and the Triton kernel's) against today's fp32 arithmetic over
    the same codes, measured against KIVI's own error (fp32 arithmetic over the codes against attention
    over the exact k, v): rms(int - fp32) < INT_VS_KIVI * rms(fp32 - exact), at 300 and 2000 tokens with
    ring keys."""
    g = torch.Generator().manual_seed(bits)
    for n in (300, 2000):
        B, H, Hq, D, G, R = 2, 3, 9, 64, 32, 128
        k, v = torch.randn(B, H, n, D, generator=g) * 2 + 0.3, torch.randn(B, H, n, D, generator=g)
        q = torch.randn(B, Hq, 1, D, generator=g)
        store = SlotStore(B, H, D, n + G, bits, G, R, torch.float32)
        pos, now = torch.arange(n).expand(B, 1, n).contiguous(), torch.full((B,), n - 1)
        store.write_range_torch(0, k, v, pos, now)
        exact = grouped_attention(q, k, v, None)
        fp32 = kivi_attention_torch(q, store.buffers, pos, None, now, n)
        out = twin(q, store.buffers, pos, None, now, n)
        rms = (out - fp32).pow(2).mean().sqrt() / (fp32 - exact).pow(2).mean().sqrt()
        print(f"{twin.__name__} bits {bits} n {n}: rms(int - fp32) / rms(fp32 - exact) = {rms:.3f}, "
              f"max |int - fp32| = {(out - fp32).abs().max():.2e}")
        assert rms < INT_VS_KIVI


@needs_cpp
def test_switch_selects_the_arithmetic(monkeypatch):
    """KVC_KIVI_ARITH: auto (default) -> the VNNI op where built, else fp32; int -> the integer op where
    built, fp32 -> today's op (== fp32 twin), other values -> ValueError; explicit arith= overrides it."""
    store, pos, now, g = random_store(2, 3, 64, 150, 4, 32, 64, seed=7)
    q = torch.randn(2, 9, 1, 64, generator=g)
    fp32 = kivi_attention_torch(q, store.buffers, pos, None, now, 150)
    auto = "vnni" if cpu.kivi_int_arith() == "vnni" else "fp32"
    for env, want in (("fp32", "fp32"), ("int", cpu.kivi_int_arith()), ("auto", auto), (None, auto)):
        if env is None:
            monkeypatch.delenv("KVC_KIVI_ARITH", raising=False)
        else:
            monkeypatch.setenv("KVC_KIVI_ARITH", env)
        monkeypatch.setattr(cpu, "_kivi_arith", None)
        assert cpu.kivi_arith_default() == want
        out = kivi_attention(q, store.buffers, pos, None, now, 150)
        ref = fp32 if want == "fp32" else kivi_attention_int_torch(q, store.buffers, pos, None, now, 150)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("KVC_KIVI_ARITH", "int4")
    monkeypatch.setattr(cpu, "_kivi_arith", None)
    with pytest.raises(ValueError, match="KVC_KIVI_ARITH"):
        cpu.kivi_arith_default()
    monkeypatch.setattr(cpu, "_kivi_arith", None)
    out = cpu.kivi_attention_cpu(q, store.buffers, pos, None, now, 150, arith="fp32")
    torch.testing.assert_close(out, fp32, atol=1e-4, rtol=1e-4)
