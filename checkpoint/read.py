"""The front door: a path -> the reader for it (a model directory or a .gguf file), every check that
needs no tensor data first (`validate_checkpoint`), the tokenizer, and finite weights after loading."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from checkpoint.check import CheckpointError
from checkpoint.gguf_file import inspect_gguf, read_gguf
from checkpoint.hf_dir import inspect_hf_dir, read_hf_dir
from kernels.qlinear import QWeight, dequantize
from model import ModelArgs
from tokenizer import Tokenizer

WEIGHTS = ("auto", "float")   # load quantized weights as they are stored, or dequantize them


# errors a corrupt tokenizer file can raise in the tokenizer's parsers (json, tiktoken, sentencepiece)
_TOKENIZER_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, RuntimeError,
                     RecursionError, OverflowError)


def _tokenizer(load, where) -> Tokenizer:
    """load() -> Tokenizer, any error from corrupt or missing tokenizer files as a CheckpointError."""
    try:
        tokenizer = load()
        tokenizer.check_chat_template()
        return tokenizer
    except _TOKENIZER_ERRORS as e:
        if isinstance(e, CheckpointError):
            raise
        text = str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
        text = text[:300]
        raise CheckpointError(text if str(where) in text else f"{where}: tokenizer: {text}") from e


def validate_checkpoint(path) -> tuple[ModelArgs, Tokenizer]:
    """(args, tokenizer) of a .gguf file or a model directory after every check that needs no tensor
    data: the file layout (GGUF header, safetensors headers), the config or metadata, each tensor's
    name, dtype and shape against it, and the tokenizer.  CheckpointError naming the file otherwise."""
    args, tokenizer, _ = _validate(Path(path))
    return args, tokenizer


def _validate(path: Path) -> tuple[ModelArgs, Tokenizer, Optional[tuple]]:
    """validate_checkpoint's (args, tokenizer) and, for a GGUF file, inspect_gguf's result (None for a
    directory), so that reading the tensors does not parse the header again."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        return inspect_hf_dir(path), _tokenizer(lambda: Tokenizer.from_dir(path), path), None
    if path.suffix != ".gguf":
        raise CheckpointError(f"{path}: expected a model directory or a .gguf file")
    inspected = inspect_gguf(path)
    meta = inspected[1]
    return inspected[0], _tokenizer(lambda: Tokenizer.from_gguf_metadata(meta, path), path), inspected


def check_finite(tensors: dict, where) -> None:
    """CheckpointError if a float tensor (or a quantized weight's scales/mins) holds NaN or inf."""
    for name, t in tensors.items():
        parts = [t.scales, t.mins] if isinstance(t, QWeight) else [t]
        if any(p is not None and p.is_floating_point() and not _all_finite(p) for p in parts):
            raise CheckpointError(f"{where}: tensor {name} holds NaN or inf values (corrupt weights)")


def _all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """torch.isfinite(t).all(), a million elements at a time (isfinite's temporaries on a whole
    embedding table would be a passing +176 MB of the loader's peak)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def read_checkpoint(path, weights: str = "float") -> tuple[ModelArgs, dict, Tokenizer]:
    """(args, HF-named tensors, tokenizer) for a .gguf file or a model directory, checked first
    (`validate_checkpoint`) and after loading (`check_finite`).  weights="float": every weight a float
    tensor (quantized ones dequantized to fp32); "auto": quantized weights as QWeights (quantized
    directories; GGUF Q8_0/Q4_0/Q4_1 linear weights)."""
    if weights not in WEIGHTS:
        raise CheckpointError(f"unknown --weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    path = Path(path)
    args, tokenizer, inspected = _validate(path)
    if path.is_dir():
        args, tensors = read_hf_dir(path)
    else:
        args, tensors = read_gguf(path, native=weights == "auto", inspected=inspected)
    check_finite(tensors, path)
    if weights == "float":
        tensors = {k: dequantize(v) if isinstance(v, QWeight) else v for k, v in tensors.items()}
    return args, tensors, tokenizer
