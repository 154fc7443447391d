"""kernels/kivi_codec.py (KIVI quantization and packing) and kernels/quantized_attention.py (scores and weighted
values straight from the packed words).

Property tests run over seeded random shapes, dtypes, bit widths and group sizes, with constant,
extreme and tiny-range groups mixed in.  (The packed KV storage is tested in tests/test_kivi.py, its
attention kernels in tests/test_kivi_kernels.py.)
"""
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.quantized_attention import (_scores_fused, _values_fused, quantized_scores,  # noqa: E402
                                         quantized_weighted_values)
from kernels.kivi_codec import dequantize_keys, dequantize_values, pack, quantize_keys, quantize_values, unpack  # noqa: E402

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


# ----------------------------------------------------------------------------------- kernels (torch)
def _kernel_inputs(B=2, H=3, Gq=3, S=160, D=64, bits=4, G=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, H, S, D, generator=g) * 2).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    qk, qv = quantize_keys(k, bits, G), quantize_values(v, bits, G)
    q = torch.randn(B, H * Gq, D, generator=g).to(dtype)
    return q, qk, qv


@pytest.mark.parametrize("bits,D,n,Gq", [(4, 64, 150, 3), (2, 64, 33, 1), (8, 128, 97, 4), (4, 128, 160, 2)])
def test_packed_scores_and_values_equal_the_dequantized_cache(bits, D, n, Gq):
    """quantized_scores / quantized_weighted_values, eagerly (several block sizes) and in the
    compile-path formulation (run eagerly here), against the dequantized keys and values."""
    q, qk, qv = _kernel_inputs(D=D, bits=bits, Gq=Gq, seed=bits + n)
    B, Hq, _ = q.shape
    H = Hq // Gq
    qg = q.float().view(B, H, Gq, D) / math.sqrt(D)
    kd, vd = dequantize_keys(qk, torch.float32), dequantize_values(qv, torch.float32)
    nt = -(-n // 32) * 32
    ref_s = qg @ kd[:, :, :nt].transpose(-1, -2)
    p = torch.rand(B, H, Gq, nt)
    ref_v = p[..., :n] @ vd[:, :, :n]
    for chunk in (32, 64, 512):
        torch.testing.assert_close(quantized_scores(qg, qk.packed, qk.scale, qk.minimum, n, bits, 32, chunk), ref_s,
                                   atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(quantized_weighted_values(p, qv.packed, qv.scale, qv.minimum, n, bits, 32, chunk),
                                   ref_v, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(_scores_fused(qg, qk.packed, qk.scale, qk.minimum, n, bits, 32), ref_s,
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(_values_fused(p, qv.packed, qv.scale, qv.minimum, n, bits, 32), ref_v,
                               atol=1e-4, rtol=1e-5)
