"""Weight-only quantization (int8 / int4) of a checkpoint's linear layers, and its CLI (gpt-fast's
quantize.py; KIVI's KV-cache codec is kernels/kivi_codec.py)

    python quantize.py --checkpoint DIR --mode int4 --groupsize 32 --out OUT_DIR

writes OUT_DIR: config.json (the model's, plus "quantization_config": the scheme), model.safetensors
(each quantized linear `X.weight` as X.qweight / X.scales [/ X.mins], the row-major format of
kernels/qlinear.py; everything else as it was) and the tokenizer files.  `engine.load_model(OUT_DIR)`
loads it.  Schemes (error per weight, for the codes below; W~ the dequantized weight):
  int8  symmetric per output channel (or per group): scale = max|w| / 127 (fp16, rounded up),
        q = round(w / scale) in [-127, 127]                          |w - W~| <= scale / 2
  int4  asymmetric (default): min = the group minimum (fp16, rounded down), scale = (max - min) / 15
        (fp16, rounded up), q = round((w - min) / scale) in [0, 15]    |w - W~| <= scale / 2
  int4  symmetric (--symmetric): scale = -w_ext / 8 with w_ext the group's largest-magnitude weight
        (fp16; llama.cpp's Q4_0 choice, all 16 levels used), min = -8 * scale,
        q = clamp(round(w / scale) + 8, 0, 15)                         |w - W~| <= |scale|
The output head (the embedding too when tied) follows --head: int8 per channel (default), int4 with
the scheme's groups, or float.  (+ fp16 rounding of the scale and min, relative 2^-11.)
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from atomic_io import exit_on_sigterm
from checkpoint import CheckpointError, linear_weight_names, read_checkpoint, write_converted_dir
from kernels.qlinear import QWeight, pack_int4

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
    """w [N, K] -> QWeight int4 (scheme in the module docstring)."""
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
    p = argparse.ArgumentParser(description="Weight-only int8/int4 quantization of a checkpoint's linear layers "
                                            "(schemes: the docstring of quantize.py)")
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
