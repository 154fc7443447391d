"""KIVI's KV codec: asymmetric min/max group quantization, keys per channel, values per token.

Layout (one place; cache/quantized.py and the kernels/ ops read exactly this)
----------------------------------------------------------------------------
Codes and words.  `bits` b in {2, 4, 8}; a code is an integer in [0, 2^b - 1].  Codes are packed
into int32 words, P = 32 // b codes per word (16, 8, 4).  `pack(codes, bits, dim)` turns n codes
along `dim` (n a multiple of P) into W = n // P words; code i lives in word i % W at bits
[b * (i // W), b * (i // W) + b) ("planar" order: word w holds codes w, w + W, w + 2W, ...), so one
constant shift of all the words yields the contiguous codes [j W, (j + 1) W) (plane j).  Bit 31 is
used: words are read as two's-complement int32 and `(word >> shift) & (2^b - 1)` recovers a code.

Keys  k [..., T, D] -> QuantizedTensor(packed [..., T, D // P] int32,
                                       scale, minimum [..., T // G, D] in k's dtype)
      quantized per channel d over groups of G consecutive tokens (T a multiple of G),
      packed along the channels (each token's D codes are its own D // P words).
Values v [..., T, D] -> QuantizedTensor(packed [..., T, D // P] int32,
                                        scale, minimum [..., T, D // G] in v's dtype)
      quantized per token over groups of G consecutive channels (D a multiple of G and of P),
      packed along the channels, so any single token can be (re)quantized on its own.

Arithmetic (per group: n = 2^b - 1 levels, lo = min, hi = max over the group, computed in fp32)
      minimum = lo (an element of the group, exact in the storage dtype)
      scale   = (hi - lo) / n rounded *up* to the storage dtype (so lo + n * scale >= hi)
      code    = clamp(round((x - lo) / scale), 0, n), with scale 0 (a constant group) -> code 0
      x~      = code * scale + minimum (fp32, then the dtype, clamped to its finite range)
A constant group has scale 0 and dequantizes to exactly its value: no division by zero, no NaN,
no inf.  Per element |x - x~| <= scale / 2, up to the rounding of fp32 and the storage dtype.
(hi - lo is formed in fp32: groups spanning more than fp32's range, |x| ~ 1.7e38, are out of scope.)

The packed KV storage itself (slot-addressed, under every policy) is cache/quantized.py; attention
over it is kernels/kivi_attention.py.  Everything here works on any device; nothing syncs with the host.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

BITS = (2, 4, 8)


class QuantizedTensor(NamedTuple):
    """packed int32 words, scale and minimum in the compute dtype (shapes in the module docstring)."""
    packed: Tensor
    scale: Tensor
    minimum: Tensor
    bits: int
    group: int


def codes_per_word(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return 32 // bits


# ------------------------------------------------------------------------------ packing
def pack(codes: Tensor, bits: int, dim: int = -1) -> Tensor:
    """uint8 codes in [0, 2^bits) -> int32 words along `dim` (its length / (32 // bits) words).
    Exact inverse: unpack(pack(c, b, d), b, d) == c.  Bits above `bits` in a code are ignored."""
    P = codes_per_word(bits)
    c = codes.movedim(dim, -1)
    n = c.shape[-1]
    if n % P:
        raise ValueError(f"packed dim has {n} codes, not a multiple of {P} ({bits}-bit codes per int32)")
    c = (c.to(torch.int64) & ((1 << bits) - 1)).reshape(*c.shape[:-1], P, n // P)
    shifts = (torch.arange(P, device=c.device, dtype=torch.int64) * bits)[:, None]
    words = (c << shifts).sum(-2)                                    # [0, 2^32) in int64
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack(words: Tensor, bits: int, dim: int = -1) -> Tensor:
    """int32 words -> uint8 codes along `dim` ((32 // bits) codes per word, planar order)."""
    P = codes_per_word(bits)
    w = words.movedim(dim, -1)
    shifts = (torch.arange(P, device=w.device, dtype=torch.int32) * bits)[:, None]
    c = (w.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)              # [..., P, W]
    return c.reshape(*w.shape[:-1], P * w.shape[-1]).to(torch.uint8).movedim(-1, dim)


# ------------------------------------------------------------------------------ quantization
def _scale_min(lo: Tensor, hi: Tensor, bits: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp32 group min/max -> (scale, minimum) in `dtype`; scale rounded up (see the docstring)."""
    levels = (1 << bits) - 1
    span = hi - lo
    scale = (span / levels).to(dtype)
    short = scale.float() * levels < span                            # dtype rounding went down
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    return scale, lo.to(dtype)


def _codes(x: Tensor, scale: Tensor, minimum: Tensor, bits: int) -> Tensor:
    """fp32 x and broadcastable scale/minimum -> uint8 codes; scale 0 -> code 0 (guarded)."""
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = ((x - minimum.float()) / safe).round_().clamp_(0, (1 << bits) - 1)
    return q.to(torch.uint8)


def quantize_keys(k: Tensor, bits: int = 4, group: int = 32, include: Optional[Tensor] = None,
                  dtype: Optional[torch.dtype] = None) -> QuantizedTensor:
    """k [..., T, D] -> per-channel codes over groups of `group` consecutive tokens.  `dtype`: of the
    scale and minimum (default k's; an fp32 k with a narrower dtype avoids rounding k first).

    include (bool, broadcastable to [..., T]): the tokens that set their group's min/max; the others
    are don't-care rows (e.g. empty cache slots), coded 0.  A group without any included token gets
    scale 0 and minimum 0."""
    *lead, T, D = k.shape
    if T % group:
        raise ValueError(f"keys: T={T} is not a multiple of the group size {group}")
    x = k.float().reshape(*lead, T // group, group, D)
    if include is None:
        lo, hi = x.amin(-2), x.amax(-2)                              # [..., T/G, D]
    else:
        inc = include.expand(*lead, T).reshape(*lead, T // group, group, 1)
        none = ~inc.any(-2)                                          # [..., T/G, 1]
        lo = torch.where(inc, x, math.inf).amin(-2).masked_fill(none, 0.0)
        hi = torch.where(inc, x, -math.inf).amax(-2).masked_fill(none, 0.0)
    scale, minimum = _scale_min(lo, hi, bits, dtype or k.dtype)
    codes = _codes(x, scale.unsqueeze(-2), minimum.unsqueeze(-2), bits)
    if include is not None:
        codes = codes * inc
    return QuantizedTensor(pack(codes.reshape(*lead, T, D), bits, -1), scale, minimum, bits, group)


def quantize_values(v: Tensor, bits: int = 4, group: int = 32, dtype: Optional[torch.dtype] = None) -> QuantizedTensor:
    """v [..., T, D] -> per-token codes over groups of `group` consecutive channels (`dtype`: as for keys)."""
    *lead, T, D = v.shape
    if D % group:
        raise ValueError(f"values: D={D} is not a multiple of the group size {group}")
    x = v.float().reshape(*lead, T, D // group, group)
    lo, hi = x.amin(-1), x.amax(-1)                                  # [..., T, D/G]
    scale, minimum = _scale_min(lo, hi, bits, dtype or v.dtype)
    codes = _codes(x, scale.unsqueeze(-1), minimum.unsqueeze(-1), bits).reshape(*lead, T, D)
    return QuantizedTensor(pack(codes, bits, -1), scale, minimum, bits, group)


def dequantize_keys(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """-> [..., T, D] in `dtype` (default: the scale's dtype)."""
    codes = unpack(qt.packed, qt.bits, -1).float()                   # [..., T, D]
    *lead, T, D = codes.shape
    x = codes.view(*lead, T // qt.group, qt.group, D) * qt.scale.float().unsqueeze(-2) \
        + qt.minimum.float().unsqueeze(-2)
    return _cast(x.reshape(*lead, T, D), dtype or qt.scale.dtype)


def dequantize_values(qt: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """-> [..., T, D] in `dtype` (default: the scale's dtype)."""
    codes = unpack(qt.packed, qt.bits, -1).float()
    *lead, T, D = codes.shape
    x = codes.view(*lead, T, D // qt.group, qt.group) * qt.scale.float().unsqueeze(-1) \
        + qt.minimum.float().unsqueeze(-1)
    return _cast(x.reshape(*lead, T, D), dtype or qt.scale.dtype)


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 -> dtype without overflowing: the scale is rounded up, so the top code of a group at
    the edge of fp16's range can land a rounding step beyond it (its value is within range)."""
    fi = torch.finfo(dtype)
    return x.clamp(fi.min, fi.max).to(dtype)
