"""quantize.py (KIVI quantization, packing, QuantizedKV) and kernels/quantized_attention.py.

Property tests run over seeded random shapes, dtypes, bit widths and group sizes, with constant,
extreme and tiny-range groups mixed in.  The Triton kernel is compared with its torch twin in ONE
subprocess (this file run as a script with TRITON_INTERPRET=1: Triton reads the variable when a
kernel is built, and something else in the pytest process may have imported Triton without it);
each case it prints is then its own test here.
"""
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.quantized_attention import (_torch_fused, merge_partials,  # noqa: E402
                                         quantized_decode_attention, quantized_decode_attention_torch)
from quantize import (QuantizedKV, dequantize_keys, dequantize_values, pack,  # noqa: E402
                      quantize_keys, quantize_values, unpack)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNIT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


# ----------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_exact_inverse(bits):
    g = torch.Generator().manual_seed(bits)
    P = 32 // bits
    for shape, dim in [((3, 5, 4 * P), -1), ((2 * P, 3), 0), ((2, 3 * P, 7), 1), ((1, 1, P), 2)]:
        codes = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
        words = pack(codes, bits, dim)
        assert words.dtype == torch.int32 and words.shape[dim] == shape[dim] // P
        assert torch.equal(unpack(words, bits, dim), codes)
    top = torch.full((4, P), (1 << bits) - 1, dtype=torch.uint8)           # every bit set, bit 31 too
    assert torch.equal(pack(top, bits), torch.full((4, 1), -1, dtype=torch.int32))
    assert torch.equal(unpack(pack(top, bits), bits), top)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (6, 4), generator=g, dtype=torch.int32)
    assert torch.equal(pack(unpack(words, bits), bits), words)              # a bijection


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_layout_is_planar(bits):
    """Code i of n along the packed dim lives in word i % W at bits [b*(i // W), b*(i // W) + b)."""
    P, W = 32 // bits, 3
    for i in range(P * W):
        codes = torch.zeros(P * W, dtype=torch.uint8)
        codes[i] = 1
        expect = torch.zeros(W, dtype=torch.int64)
        expect[i % W] = 1 << (bits * (i // W))
        expect = torch.where(expect >= 2 ** 31, expect - 2 ** 32, expect).to(torch.int32)
        assert torch.equal(pack(codes, bits), expect), i


# ----------------------------------------------------------------------------------- quantization
def _random_case(g, dtype, kind):
    """A [B, H, T, D] tensor whose groups mix ordinary, constant, extreme and tiny-range data."""
    group = [16, 32, 64][int(torch.randint(0, 3, (1,), generator=g))]
    B, H = (int(x) for x in torch.randint(1, 4, (2,), generator=g))
    T = group * int(torch.randint(1, 4, (1,), generator=g))
    D = 64 * int(torch.randint(1, 3, (1,), generator=g))
    mag = 10.0 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
    x = torch.randn(B, H, T, D, generator=g) * mag + float(torch.randn(1, generator=g)) * mag
    big = 6e4 if dtype == torch.float16 else 1e4
    if kind == "keys":   # groups: G tokens of one channel
        x[0, 0, :group, 0] = 3.0                                             # constant
        x[0, 0, :group, 1] = torch.where(torch.arange(group) % 2 == 0, big, -big)   # extreme
        x[0, 0, :group, 2] = 1000.0 + torch.arange(group) * 1e-3              # tiny range, offset
        x[-1, -1, -group:, -1] = 0.0
    else:                # groups: G channels of one token
        x[0, 0, 0, :group] = -7.25
        x[0, 0, 1, :group] = torch.where(torch.arange(group) % 2 == 0, big, -big)
        x[0, 0, 2, :group] = 1000.0 + torch.arange(group) * 1e-3
        x[-1, -1, -1, -group:] = 0.0
    return x.to(dtype), group


def _expand(scale, kind, group):
    return scale.repeat_interleave(group, dim=-2 if kind == "keys" else -1)


@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_round_trip_error_within_half_a_step(kind, dtype):
    """|x - dequantize(quantize(x))| <= scale / 2 (+ the dtype's rounding), per element, for random
    shapes / groups / bits; constant groups are exact; nothing is NaN or inf; the stored scale is
    rounded up (min + levels * scale >= max)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{dtype}".encode()))
    quant, deq = (quantize_keys, dequantize_keys) if kind == "keys" else (quantize_values, dequantize_values)
    for trial in range(12):
        bits = (2, 4, 8)[trial % 3]
        x, group = _random_case(g, dtype, kind)
        qt = quant(x, bits, group)
        assert qt.scale.dtype == qt.minimum.dtype == dtype and qt.packed.dtype == torch.int32
        y = deq(qt)
        assert y.dtype == dtype and y.shape == x.shape
        for t in (qt.scale, qt.minimum, y):
            assert torch.isfinite(t).all()
        xf, yf = x.float(), y.float()
        levels = (1 << bits) - 1
        s = _expand(qt.scale.float(), kind, group)
        lo = _expand(qt.minimum.float(), kind, group)
        # fp32 arithmetic on terms as large as |min| and levels * scale, then the dtype's rounding
        slack = 4 * UNIT[torch.float32] * (lo.abs() + levels * s)
        bound = s / 2 + slack + UNIT[dtype] * torch.maximum(xf.abs(), yf.abs()) + 1e-30
        err = (xf - yf).abs()
        assert (err <= bound).all(), f"trial {trial}: max excess {(err - bound).max().item()}"
        const = s == 0
        assert torch.equal(xf[const], yf[const])
        assert (lo + levels * s >= xf - slack).all() and (lo <= xf).all()


def test_constant_and_extreme_tensors():
    for dtype in DTYPES.values():
        for bits in (2, 4, 8):
            c = torch.full((2, 3, 64, 64), -0.3, dtype=dtype)
            for quant, deq in ((quantize_keys, dequantize_keys), (quantize_values, dequantize_values)):
                qt = quant(c, bits, 32)
                assert torch.equal(qt.scale, torch.zeros_like(qt.scale))
                assert torch.equal(deq(qt), c)
            # the largest magnitudes whose group span still fits fp32 arithmetic (fp16: its max)
            big = torch.finfo(dtype).max if dtype == torch.float16 else 1e38
            ext = torch.tensor([big, -big] * 32, dtype=dtype).view(1, 1, 1, 64).expand(1, 1, 32, 64)
            for quant, deq in ((quantize_keys, dequantize_keys), (quantize_values, dequantize_values)):
                y = deq(quant(ext.contiguous(), bits, 32))
                assert torch.isfinite(y).all() and torch.equal(y, ext)


def test_quantize_rejects_bad_groups():
    with pytest.raises(ValueError):
        quantize_keys(torch.randn(1, 1, 40, 64), 4, 32)
    with pytest.raises(ValueError):
        quantize_values(torch.randn(1, 1, 40, 48), 4, 32)
    with pytest.raises(ValueError):
        pack(torch.zeros(7, dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        quantize_keys(torch.randn(1, 1, 32, 64), 3, 32)


# ----------------------------------------------------------------------------------- storage
def _naive_attention(q, k, v, mask=None, scale=None):
    """q [B, Hq, 1, D], k/v [B, H, n, D] fp32 -> [B, Hq, 1, D] (softmax over the visible slots)."""
    B, Hq, _, D = q.shape
    H = k.shape[1]
    qg = q.float().view(B, H, Hq // H, D)
    s = qg @ k.float().transpose(-1, -2) * (scale or 1 / math.sqrt(D))
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None], float("-inf"))
    return (s.softmax(-1) @ v.float()).view(B, Hq, 1, D)


def _fill(kv, k, v, n_prefill):
    kv.append_prefill(k[:, :, :n_prefill], v[:, :, :n_prefill])
    for t in range(n_prefill, k.shape[2]):
        kv.append(k[:, :, t:t + 1], v[:, :, t:t + 1])


@pytest.mark.parametrize("bits,group,residual,n_prefill,n_total", [
    (4, 32, 32, 77, 170), (2, 32, 64, 10, 140), (8, 16, 32, 0, 50), (4, 32, 32, 20, 25), (4, 32, 32, 128, 128)])
def test_attend_equals_attention_over_the_dequantized_cache(bits, group, residual, n_prefill, n_total):
    g = torch.Generator().manual_seed(bits * 1000 + n_total)
    B, H, Hq, D, C = 2, 3, 9, 64, 192
    k = torch.randn(B, H, n_total, D, generator=g) * 2 + 0.5
    v = torch.randn(B, H, n_total, D, generator=g)
    kv = QuantizedKV(B, H, D, C, bits=bits, group=group, residual=residual)
    kv.append_prefill(k[:, :, :n_prefill], v[:, :, :n_prefill])
    for t in range(n_prefill, n_total + 1):
        if t > 0 and (t - n_prefill) % 7 == 0 or t == n_total:   # check along the way
            q = torch.randn(B, Hq, 1, D, generator=g)
            kd, vd = kv.dequantized(torch.float32)
            assert kd.shape[2] == t
            out = kv.attend(q)
            assert out.shape == q.shape
            assert torch.allclose(out, _naive_attention(q, kd, vd), atol=1e-5, rtol=1e-5)
            mask = torch.rand(B, H, t, generator=g) > 0.4
            mask[:, :, 0] = True
            assert torch.allclose(kv.attend(q, mask), _naive_attention(q, kd, vd, mask), atol=1e-5, rtol=1e-5)
            m2 = mask[:, :1].expand(B, 1, t)                                   # one mask for all heads
            assert torch.allclose(kv.attend(q, m2[:, 0], scale=0.3),
                                  _naive_attention(q, kd, vd, m2.expand(B, H, t), 0.3), atol=1e-5, rtol=1e-5)
        if t < n_total:
            kv.append(k[:, :, t:t + 1], v[:, :, t:t + 1])


@pytest.mark.parametrize("bits", [4, 2])
def test_attend_close_to_unquantized_attention(bits):
    """Error of attention from the quantized cache vs exact attention, within the bound that
    follows from per-element errors <= scale / 2: scores move by at most
    delta_t = scale * sum_d |q_d| k_scale_{g(t),d} / 2, so the softmax weights by at most
    exp(2 max delta) - 1 in L1, and each value element by at most v_scale / 2."""
    g = torch.Generator().manual_seed(bits)
    B, H, Hq, D, C, n = 2, 3, 9, 64, 256, 200
    k = torch.randn(B, H, n, D, generator=g) * 1.5
    v = torch.randn(B, H, n, D, generator=g)
    kv = QuantizedKV(B, H, D, C, bits=bits)
    _fill(kv, k, v, 150)
    q = torch.randn(B, Hq, 1, D, generator=g)
    exact = _naive_attention(q, k, v)
    out = kv.attend(q)
    ks = torch.cat([kv.k_scale[:, :, :kv.n_packed_keys // 32].float().repeat_interleave(32, 2),
                    torch.zeros(B, H, n - kv.n_packed_keys, D)], dim=2)         # residual: exact
    qg = q.view(B, H, Hq // H, D).abs()
    delta = (qg @ ks.transpose(-1, -2) / 2 / math.sqrt(D)).amax(-1).view(B, Hq, 1, 1)
    v_err = kv.v_scale[:, :, :kv.n_packed_values].float().amax((2, 3)) / 2       # [B, H]
    v_err = v_err.repeat_interleave(Hq // H, 1)[:, :, None, None]
    bound = v_err + (torch.exp(2 * delta) - 1) * (v.abs().amax((2, 3)).repeat_interleave(Hq // H, 1)[:, :, None, None]
                                                  + v_err)
    err = (out - exact).abs()
    assert (err <= bound).all()
    if bits == 4:   # in practice far inside it: here ~2.4% of the values' mean magnitude
        assert err.mean() < 0.03 * v.abs().mean()


def test_keys_flush_block_wise_and_old_words_never_change():
    g = torch.Generator().manual_seed(7)
    B, H, D, C, R = 2, 3, 64, 256, 64
    kv = QuantizedKV(B, H, D, C, bits=4, group=32, residual=R)
    k = torch.randn(B, H, 3 * R + 5, D, generator=g)
    v = torch.randn(B, H, 3 * R + 5, D, generator=g)
    kv.append_prefill(k[:, :, :R + 5], v[:, :, :R + 5])
    assert (kv.n, kv.n_packed_keys, kv.n_packed_values) == (R + 5, R, 5)
    t = R + 5
    for block in range(2):
        before = {name: getattr(kv, name).clone() for name in
                  ("k_packed", "k_scale", "k_min", "v_packed", "v_scale", "v_min")}
        nk0, nv0 = kv.n_packed_keys, kv.n_packed_values
        while True:
            kv.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
            t += 1
            assert kv.n_packed_values == t - R                                   # values: a FIFO
            if kv.n % R == 0:
                break
            assert kv.n_packed_keys == nk0                                       # no partial flush
        assert kv.n_packed_keys == nk0 + R and kv.n_packed_keys == kv.n          # residual now empty
        assert torch.equal(kv.k_packed[:, :, :nk0], before["k_packed"][:, :, :nk0])
        assert torch.equal(kv.k_scale[:, :, :nk0 // 32], before["k_scale"][:, :, :nk0 // 32])
        assert torch.equal(kv.k_min[:, :, :nk0 // 32], before["k_min"][:, :, :nk0 // 32])
        assert torch.equal(kv.v_packed[:, :, :nv0], before["v_packed"][:, :, :nv0])
        assert torch.equal(kv.v_scale[:, :, :nv0], before["v_scale"][:, :, :nv0])
        # the flushed block is exactly quantize_keys of those R keys (whole groups, once)
        fresh = quantize_keys(k[:, :, kv.n - R:kv.n], 4, 32)
        assert torch.equal(kv.k_packed[:, :, kv.n - R:kv.n], fresh.packed)
        assert torch.equal(kv.k_scale[:, :, (kv.n - R) // 32:kv.n // 32], fresh.scale)


def test_prefill_in_one_call_equals_token_by_token():
    g = torch.Generator().manual_seed(3)
    B, H, D, C = 1, 2, 64, 320
    k = torch.randn(B, H, 300, D, generator=g).half()
    v = torch.randn(B, H, 300, D, generator=g).half()
    ref = QuantizedKV(B, H, D, C, dtype=torch.float16)
    _fill(ref, k, v, 0)
    for splits in ([300], [45, 255], [13, 19, 200, 68], [0, 32, 268]):
        kv = QuantizedKV(B, H, D, C, dtype=torch.float16)
        t = 0
        for s in splits:
            kv.append_prefill(k[:, :, t:t + s], v[:, :, t:t + s])
            t += s
        for name in ("k_packed", "k_scale", "k_min", "v_packed", "v_scale", "v_min"):
            assert torch.equal(getattr(kv, name)[:, :, :kv.n_packed_values // 32 * 32 or None],
                               getattr(ref, name)[:, :, :ref.n_packed_values // 32 * 32 or None]), (splits, name)
        kd, vd = kv.dequantized()
        rd, rv = ref.dequantized()
        assert torch.equal(kd, rd) and torch.equal(vd, rv)


def test_nbytes_exact():
    B, H, D, C, G, R = 2, 3, 64, 256, 32, 64
    for bits, dtype, e in ((4, torch.float16, 2), (2, torch.float32, 4)):
        P = 32 // bits
        kv = QuantizedKV(B, H, D, C, bits=bits, group=G, residual=R, dtype=dtype)
        words = C * (D // P) * 4
        hand = B * H * (2 * words + 2 * (C // G) * D * e + 2 * C * (D // G) * e + 2 * R * D * e)
        assert kv.nbytes() == hand
        assert kv.nbytes(live=True) == 0
        kv.append_prefill(torch.randn(B, H, 150, D), torch.randn(B, H, 150, D))   # 128 keys, 86 values packed
        live = B * H * (128 * (D // P) * 4 + 2 * (128 // G) * D * e + 22 * D * e          # keys
                        + 86 * (D // P) * 4 + 2 * 86 * (D // G) * e + 64 * D * e)        # values
        assert kv.nbytes(live=True) == live
        assert kv.nbytes() == hand                                                        # static


def test_storage_edge_cases():
    B, H, D = 1, 1, 64
    kv = QuantizedKV(B, H, D, 64)
    with pytest.raises(ValueError):
        kv.attend(torch.randn(B, 1, 1, D))                                    # empty
    const = torch.full((B, H, 64, D), 0.5)
    kv.append_prefill(const, const)
    out = kv.attend(torch.randn(B, 2, 1, D))
    assert torch.isfinite(out).all() and torch.allclose(out, torch.full_like(out, 0.5))
    with pytest.raises(ValueError):
        kv.append(const[:, :, :1], const[:, :, :1])                          # full
    kv.reset()
    assert kv.n == 0 and kv.nbytes(live=True) == 0
    with pytest.raises(ValueError):
        QuantizedKV(B, H, D, 100, residual=32)                               # capacity % R
    with pytest.raises(ValueError):
        QuantizedKV(B, H, D, 64, residual=48, group=32)                      # R % G
    # a row with every slot masked gives 0, no NaN
    kv.append_prefill(const, const)
    mask = torch.zeros(B, H, 64, dtype=torch.bool)
    assert torch.equal(kv.attend(torch.randn(B, 2, 1, D), mask), torch.zeros(B, 2, 1, D))


# ----------------------------------------------------------------------------------- kernels (torch)
def _kernel_inputs(B=2, H=3, Gq=3, S=160, D=64, bits=4, G=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, H, S, D, generator=g) * 2).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    qk, qv = quantize_keys(k, bits, G), quantize_values(v, bits, G)
    q = torch.randn(B, H * Gq, D, generator=g).to(dtype)
    return q, qk, qv


def _reference(q, qk, qv, n, mask=None, scale=None):
    B, Hq, D = q.shape
    H = qk.packed.shape[1]
    kd, vd = dequantize_keys(qk, torch.float32)[:, :, :n], dequantize_values(qv, torch.float32)[:, :, :n]
    s = q.float().view(B, H, Hq // H, D) @ kd.transpose(-1, -2) * (scale or 1 / math.sqrt(D))
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None, :n], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (s.softmax(-1) @ vd).view(B, Hq, D), lse.view(B, Hq)


@pytest.mark.parametrize("bits,D,n,Gq", [(4, 64, 150, 3), (2, 64, 33, 1), (8, 128, 97, 4), (4, 128, 160, 2)])
def test_torch_twin_and_fused_formulation(bits, D, n, Gq):
    """The eager twin (several chunk sizes) and the compile-path formulation (run eagerly here)
    against attention over the dequantized cache, with and without a mask."""
    q, qk, qv = _kernel_inputs(D=D, bits=bits, Gq=Gq, seed=bits + n)
    B, Hq, _ = q.shape
    H = Hq // Gq
    mask = torch.rand(B, 1, 160) > 0.3
    for m in (None, mask, mask.expand(B, H, 160)):
        ref, ref_lse = _reference(q, qk, qv, n, m)
        args = (q, qk.packed, qk.scale, qk.minimum, qv.packed, qv.scale, qv.minimum, n, bits, 32, m)
        for chunk in (32, 64, 512):
            out, lse = quantized_decode_attention_torch(*args, chunk=chunk)
            assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
        qg = q.float().view(B, H, Gq, D) / math.sqrt(D)
        out, lse = _torch_fused(qg, *args[1:])
        assert torch.allclose(out.view(B, Hq, D), ref, atol=1e-5)
        assert torch.allclose(lse.view(B, Hq), ref_lse, atol=1e-5)


def test_merge_partials_and_dispatch():
    q, qk, qv = _kernel_inputs()
    args = (qk.packed, qk.scale, qk.minimum, qv.packed, qv.scale, qv.minimum)
    full, full_lse = _reference(q, qk, qv, 160)
    m1 = torch.zeros(2, 3, 160, dtype=torch.bool)
    m1[..., :70] = True
    o1, l1 = quantized_decode_attention(q, *args, 160, 4, 32, m1)              # auto -> torch on CPU
    o2, l2 = quantized_decode_attention(q, *args, 160, 4, 32, ~m1, backend="torch")
    out, lse = merge_partials(o1, l1, o2, l2)
    assert torch.allclose(out, full, atol=1e-5) and torch.allclose(lse, full_lse, atol=1e-5)
    none = torch.zeros_like(m1)
    o0, l0 = quantized_decode_attention(q, *args, 160, 4, 32, none)
    assert torch.equal(o0, torch.zeros_like(o0)) and torch.isinf(l0).all()
    out, lse = merge_partials(o0, l0, o0, l0)
    assert torch.equal(out, o0) and not torch.isnan(out).any()
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            quantized_decode_attention(q, *args, 160, 4, 32, backend="triton")


@pytest.mark.slow
def test_compiled_twin_matches_eager():
    """torch.compile picks the fused bit-plane formulation (slow to compile: minutes on 2 cores)."""
    q, qk, qv = _kernel_inputs(bits=8, S=128)
    args = (q, qk.packed, qk.scale, qk.minimum, qv.packed, qv.scale, qv.minimum, 100, 8, 32, None)
    compiled = torch.compile(quantized_decode_attention_torch, dynamic=False, fullgraph=True)
    out, lse = compiled(*args)
    ref, ref_lse = quantized_decode_attention_torch(*args)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)


# ----------------------------------------------------------------------------------- Triton (interpreter)
def _triton_cases():
    """Yields (name, max |triton - torch| of out, of lse, tolerance)."""
    from kernels.quantized_attention import quantized_decode_attention_triton
    cases = [  # bits, D, dtype, n, Gq, mask kind, n_splits, block_t
        (4, 64, torch.float32, 150, 3, None, None, None),
        (4, 64, torch.float32, 150, 3, "heads", 3, 32),
        (2, 64, torch.float16, 100, 3, "shared", 2, None),
        (8, 128, torch.bfloat16, 70, 4, "heads", 2, None),
        (4, 128, torch.float16, 33, 1, None, 1, None),
        (2, 128, torch.bfloat16, 160, 2, "shared", 4, 16),
        (4, 64, torch.float32, 96, 3, "empty_row", 2, None),
    ]
    for bits, D, dtype, n, Gq, mk, ns, bt in cases:
        q, qk, qv = _kernel_inputs(D=D, bits=bits, Gq=Gq, dtype=dtype, seed=n + bits)
        B, Hq, _ = q.shape
        H = Hq // Gq
        g = torch.Generator().manual_seed(n)
        mask = None
        if mk == "heads":
            mask = torch.rand(B, H, 160, generator=g) > 0.3
        elif mk == "shared":
            mask = torch.rand(B, 1, 160, generator=g) > 0.3
        elif mk == "empty_row":
            mask = torch.rand(B, H, 160, generator=g) > 0.3
            mask[0, 1] = False
        args = (q, qk.packed, qk.scale, qk.minimum, qv.packed, qv.scale, qv.minimum, n, bits, 32, mask)
        o1, l1 = quantized_decode_attention_triton(*args, n_splits=ns, block_t=bt)
        o2, l2 = quantized_decode_attention_torch(*args)
        fin = torch.isfinite(l2)
        assert torch.equal(torch.isfinite(l1), fin) and not torch.isnan(o1).any()
        name = f"b{bits}-D{D}-{str(dtype)[6:]}-n{n}-Gq{Gq}-{mk}-s{ns}"
        yield name, (o1 - o2).abs().max().item(), (l1[fin] - l2[fin]).abs().max().item(), 2e-5
    # the storage end to end: backend "triton" vs "torch"
    g = torch.Generator().manual_seed(11)
    B, H, D = 2, 3, 64
    k, v = torch.randn(B, H, 150, D, generator=g), torch.randn(B, H, 150, D, generator=g)
    outs = []
    for backend in ("triton", "torch"):
        kv = QuantizedKV(B, H, D, 192, backend=backend)
        _fill(kv, k, v, 120)
        outs.append(kv.attend(torch.randn(B, 9, 1, D, generator=torch.Generator().manual_seed(1))))
    yield "QuantizedKV.attend", (outs[0] - outs[1]).abs().max().item(), 0.0, 2e-5


TRITON_CASES = ["b4-D64-float32-n150-Gq3-None-sNone", "b4-D64-float32-n150-Gq3-heads-s3",
                "b2-D64-float16-n100-Gq3-shared-s2", "b8-D128-bfloat16-n70-Gq4-heads-s2",
                "b4-D128-float16-n33-Gq1-None-s1", "b2-D128-bfloat16-n160-Gq2-shared-s4",
                "b4-D64-float32-n96-Gq3-empty_row-s2", "QuantizedKV.attend"]


@pytest.fixture(scope="module")
def triton_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--triton-cases"], cwd=ROOT,
                          env=env, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}


@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_interpreter_equals_torch_twin(triton_results, name):
    r = triton_results[name]
    assert r["out"] <= r["tol"] and r["lse"] <= r["tol"], r


if __name__ == "__main__" and "--triton-cases" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case_name, d_out, d_lse, tol in _triton_cases():
        print(json.dumps({"name": case_name, "out": d_out, "lse": d_lse, "tol": tol}), flush=True)
