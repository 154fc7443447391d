"""KIVI-style KV-cache quantization: asymmetric min/max, keys per channel, values per token.

Layout (one place; cache/quantized.py and kernels/ read exactly this)
--------------------------------------------------------------------
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

from kernels.qlinear import QWeight, pack_int4

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


# ==================================================================================================
# Weight-only quantization (int8 / int4) of a checkpoint's linear layers, and the CLI
#
#     python quantize.py --checkpoint DIR --mode int4 --groupsize 32 --out OUT_DIR
#
# writes OUT_DIR: config.json (the model's, plus "quantization_config": the scheme), model.safetensors
# (each quantized linear `X.weight` as X.qweight / X.scales [/ X.mins], the row-major format of
# kernels/qlinear.py; everything else as it was) and the tokenizer files.  `engine.load_model(OUT_DIR)`
# loads it.  Schemes (error per weight, for the codes below; W~ the dequantized weight):
#   int8  symmetric per output channel (or per group): scale = max|w| / 127 (fp16, rounded up),
#         q = round(w / scale) in [-127, 127]                          |w - W~| <= scale / 2
#   int4  asymmetric (default): min = the group minimum (fp16, rounded down), scale = (max - min) / 15
#         (fp16, rounded up), q = round((w - min) / scale) in [0, 15]    |w - W~| <= scale / 2
#   int4  symmetric (--symmetric): scale = -w_ext / 8 with w_ext the group's largest-magnitude weight
#         (fp16; llama.cpp's Q4_0 choice, all 16 levels used), min = -8 * scale,
#         q = clamp(round(w / scale) + 8, 0, 15)                         |w - W~| <= |scale|
# The output head (the embedding too when tied) follows --head: int8 per channel (default), int4 with
# the scheme's groups, or float.  (+ fp16 rounding of the scale and min, relative 2^-11.)
# ==================================================================================================
WEIGHT_MODES = ("int8", "int4")
HEAD_MODES = ("int8", "int4", "float")


def _fp16_up(x: Tensor) -> Tensor:
    """fp32 -> the nearest fp16 >= x (x >= 0 finite)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _fp16_down(x: Tensor) -> Tensor:
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _safe(scale: Tensor) -> Tensor:
    s = scale.float()
    return torch.where(s != 0, s, torch.ones_like(s))


def quantize_int8(w: Tensor, group: int = 0) -> QWeight:
    """w [N, K] -> QWeight int8, symmetric; group 0 = per output channel (G = K)."""
    N, K = w.shape
    G = group or K
    x = w.float().reshape(N, K // G, G)
    scale = _fp16_up(x.abs().amax(-1) / 127)
    q = torch.round(x / _safe(scale)[..., None]).clamp_(-127, 127)
    return QWeight(q.to(torch.int8).reshape(N, K), scale, None, 8, G)


def quantize_int4(w: Tensor, group: int = 32, symmetric: bool = False) -> QWeight:
    """w [N, K] -> QWeight int4 (scheme in the section comment above)."""
    N, K = w.shape
    x = w.float().reshape(N, K // group, group)
    if symmetric:
        ext = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]      # signed largest magnitude
        scale = (ext / -8).to(torch.float16)
        minimum = scale * -8                                              # exact in fp16
        q = torch.round(x / _safe(scale)[..., None]) + 8
    else:
        minimum = _fp16_down(x.amin(-1))
        scale = _fp16_up((x.amax(-1) - minimum.float()) / 15)
        q = torch.round((x - minimum.float()[..., None]) / _safe(scale)[..., None])
    codes = q.clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return QWeight(pack_int4(codes), scale, minimum, 4, group)


def quantize_weight(w: Tensor, mode: str, group: int = 0, symmetric: bool = False) -> QWeight:
    """One weight [N, K] -> QWeight of `mode` ("int8": group 0 = per channel; "int4": group 32..)."""
    if not torch.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    N, K = w.shape
    G = group or (K if mode == "int8" else 32)
    if G % 32 or K % G:
        raise ValueError(f"group size {G} does not divide the input dimension {K} (or is not a multiple of 32)")
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(WEIGHT_MODES)}")
    qw = quantize_int8(w, group) if mode == "int8" else quantize_int4(w, G, symmetric)
    if not all(torch.isfinite(t).all() for t in (qw.scales, qw.mins) if t is not None):
        raise ValueError("weights beyond the fp16 range of the scales")
    return qw


def quantize_state(tensors: dict, args, scheme: dict) -> dict:
    """HF-named float tensors -> the same dict with every linear weight (and the head per
    scheme["head"]) replaced by a QWeight.  ValueError when a group size does not fit a layer."""
    from checkpoint import linear_weight_names
    head_names = {"lm_head.weight"} | ({"model.embed_tokens.weight"} if args.tie_word_embeddings else set())
    out = dict(tensors)
    for name in linear_weight_names(args):
        is_head = name in head_names
        mode = scheme["head"] if is_head else scheme["mode"]
        if mode == "float" or name not in out:
            continue
        group = 0 if mode == "int8" and (is_head or not scheme["group_size"]) else scheme["group_size"]
        try:
            out[name] = quantize_weight(out[name], mode, group, scheme["symmetric"])
        except ValueError as e:
            raise ValueError(f"{name} {tuple(out[name].shape)}: {e}") from None
    return out


def quantize_checkpoint(source, out, mode: str, group: Optional[int], symmetric: bool, head: str) -> dict:
    """Read `source` (HF/converted directory or .gguf), quantize, write `out` -> the scheme written."""
    import sys

    from checkpoint import CheckpointError, read_checkpoint, write_converted_dir
    args, tensors, tokenizer = read_checkpoint(source, weights="float")
    if getattr(args, "quantization", None):
        raise CheckpointError(f"{source} is already quantized ({args.quantization['mode']}); quantize its float source")
    if getattr(args, "gguf_quantized", False):
        print(f"note: {source} holds quantized GGUF tensors: they are dequantized and quantized again "
              f"(load the .gguf itself to run its own weights)", file=sys.stderr)
    if group is not None and (group <= 0 or group % 32):
        raise ValueError(f"--groupsize must be a positive multiple of 32, got {group}")
    if symmetric and mode != "int4":
        raise ValueError("--symmetric applies to int4 (int8 is always symmetric)")
    scheme = {"mode": mode, "group_size": group if group is not None else (32 if mode == "int4" else 0),
              "symmetric": symmetric, "head": head}
    write_converted_dir(out, args, quantize_state(tensors, args, scheme), tokenizer, quantization=scheme)
    return scheme


def main(argv=None) -> int:
    import argparse
    import sys
    from pathlib import Path

    from atomic_io import exit_on_sigterm
    from checkpoint import CheckpointError
    p = argparse.ArgumentParser(description="Weight-only int8/int4 quantization of a checkpoint's linear layers "
                                            "(scheme: the comment above quantize_int8 in quantize.py)")
    p.add_argument("--checkpoint", required=True, type=Path, help="HF/converted model directory or .gguf file")
    p.add_argument("--mode", required=True, choices=WEIGHT_MODES)
    p.add_argument("--groupsize", type=int, help="input channels per scale: int4 default 32 (64, 128, ...); "
                                                 "int8 default: one scale per output channel")
    p.add_argument("--symmetric", action="store_true", help="int4 without a per-group minimum (4.5 instead of "
                                                            "5 bits a weight at groupsize 32)")
    p.add_argument("--head", choices=HEAD_MODES, default="int8",
                   help="output head (and a tied embedding): int8 per channel (default), int4, or float")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    a = p.parse_args(argv)
    exit_on_sigterm()
    try:
        scheme = quantize_checkpoint(a.checkpoint, a.out, a.mode, a.groupsize, a.symmetric, a.head)
    except (CheckpointError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {a.out} left as it was", file=sys.stderr)
        return 130
    print(f"wrote {a.out} ({scheme})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
