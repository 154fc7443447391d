"""HuggingFace model directories (config.json + safetensors + tokenizer files): safetensors headers
checked against the file, the tensors read; and writing such a directory (`write_converted_dir`,
float or quantized), which transformers can load too."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from atomic_io import atomic_dir, write_json
from checkpoint.check import CheckpointError, check_config
from checkpoint.quantized_dir import QUANT_METHOD, collect_qweights, flatten_qweights, read_quantization
from model import ModelArgs


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
              "I8": torch.int8}


ST_MAX_HEADER = 100 << 20    # bytes of JSON header (the safetensors library's own limit)


class STEntry(NamedTuple):
    dtype: str
    shape: tuple
    start: int         # data offsets, from the end of the header
    end: int


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _st_entry(path, name: str, info, data_bytes: int) -> STEntry:
    """One header entry, checked: a known dtype, a shape of non-negative ints whose byte count is what
    the offsets span, the span inside the data section."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: header entry of tensor {name[:80]} is not a dtype/shape/data_offsets object")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {str(dtype)[:20]}")
    ints = lambda v, n=None: (isinstance(v, list) and (n is None or len(v) == n) and len(v) <= 8
                              and all(type(x) is int and x >= 0 for x in v))
    if not ints(shape) or not ints(offsets, 2) or offsets[0] > offsets[1]:
        raise CheckpointError(f"{path}: tensor {name} has an invalid shape {str(shape)[:40]} or data_offsets "
                              f"{str(offsets)[:40]}")
    if offsets[1] > data_bytes:
        raise CheckpointError(f"{path}: truncated or corrupt: tensor {name} (data bytes {offsets[0]}..{offsets[1]}) "
                              f"ends past the end of the file's {data_bytes} data bytes")
    if math.prod(shape) * _ST_DTYPES[dtype].itemsize != offsets[1] - offsets[0]:
        raise CheckpointError(f"{path}: tensor {name}: shape {shape} of {dtype} needs "
                              f"{math.prod(shape) * _ST_DTYPES[dtype].itemsize} bytes, data_offsets span "
                              f"{offsets[1] - offsets[0]}")
    return STEntry(dtype, tuple(shape), offsets[0], offsets[1])


def safetensors_header(path: Path) -> tuple[dict[str, STEntry], int]:
    """({tensor name: STEntry}, byte offset of the data section) of a .safetensors file, every entry
    checked against the file's size, tensors not overlapping (CheckpointError naming the file)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > min(size - 8, ST_MAX_HEADER):
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header says {header_len} "
                                      f"bytes, the file has {size})")
            header = json.loads(f.read(header_len), object_pairs_hook=_no_duplicates)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, UTF-8 or a duplicate key
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base = 8 + header_len
    entries = {name: _st_entry(path, name, info, size - base) for name, info in header.items() if name != "__metadata__"}
    spans = sorted((e.start, e.end, name) for name, e in entries.items() if e.end > e.start)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensors {a} and {b} overlap")
    return entries, base


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one .safetensors file (header checked: `safetensors_header`), each read into memory of
    its own.  Not memory-mapped: the loader fuses or repacks most weights into new tensors, and a mapping
    keeps every page it has read resident (the fp32 default model: 513 MB of file pages beside 280 MB of
    fused copies), while a tensor read on its own is freed once it is consumed."""
    entries, base = safetensors_header(path)
    tensors = {}
    with open(path, "rb") as f:
        for name, e in entries.items():
            dtype = _ST_DTYPES[e.dtype]
            t = torch.empty(e.shape, dtype=dtype)
            f.seek(base + e.start)
            if e.end > e.start and f.readinto(t.view(-1).view(torch.uint8).numpy()) != e.end - e.start:
                raise CheckpointError(f"{path}: truncated while reading tensor {name} (the file changed)")
            tensors[name] = t
    return tensors


def _hf_config(path: Path) -> tuple[ModelArgs, dict]:
    """(ModelArgs, config dict) of a model directory's config.json."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a HuggingFace model directory)")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, RecursionError) as e:   # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"{config_path}: invalid JSON ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    try:
        args = ModelArgs.from_hf_config(config)
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CheckpointError(f"{config_path}: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}{e}") from e
    if "quantization_config" in config:
        args.quantization = read_quantization(config["quantization_config"], config_path)
    return args, config


def _weight_files(path: Path) -> list[Path]:
    """The .safetensors files of a model directory (from its index, if any); only plain file names inside
    the directory are accepted."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # ValueError: bad JSON/UTF-8
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from e
        bad = [f for f in files if not isinstance(f, str) or Path(f).name != f or f in (".", "..")]
        if bad:
            raise CheckpointError(f"{index}: weight file {str(bad[0])[:80]!r} is not a file name inside the directory")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights (PyTorch .bin files are not supported)")
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: weight file {name} listed in the index is missing")
    return [path / name for name in files]


def inspect_hf_dir(path: Path) -> ModelArgs:
    """ModelArgs of a model directory whose config, safetensors headers (dtypes, shapes, offsets) and tensor
    set are checked against each other (`check_config`); reads no tensor data."""
    args, _ = _hf_config(path)
    shapes = {}
    for file in _weight_files(path):
        for name, e in safetensors_header(file)[0].items():
            if name in shapes:
                raise CheckpointError(f"{file}: tensor {name} is also in another weight file")
            if name.endswith((".scales", ".mins")):
                continue
            if name.endswith(".qweight"):   # int8 codes, or two int4 codes a byte
                if len(e.shape) != 2 or e.dtype not in ("I8", "U8"):
                    raise CheckpointError(f"{file}: quantized tensor {name} must be a 2-d I8/U8 array, got "
                                          f"{e.dtype} {list(e.shape)}")
                name, e = name[:-len(".qweight")] + ".weight", e._replace(shape=(e.shape[0], e.shape[1] * (1 + (e.dtype == "U8"))))
            elif e.dtype not in ("F32", "F16", "BF16", "F64"):
                raise CheckpointError(f"{file}: tensor {name} has dtype {e.dtype}, a float type is needed")
            shapes[name] = e.shape
    check_config(args, shapes, path)
    return args


def read_hf_dir(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """ModelArgs and HF-named tensors of a HuggingFace (or converted) model directory (checked first:
    `inspect_hf_dir`)."""
    args = inspect_hf_dir(path)
    tensors = {}
    for file in _weight_files(path):
        tensors.update(read_safetensors(file))
    if getattr(args, "quantization", None):
        tensors = collect_qweights(tensors, args, path)
    return args, tensors



def write_converted_dir(out: Path, args: ModelArgs, hf_tensors: dict, tokenizer,
                        quantization: Optional[dict] = None) -> None:
    """Write a HuggingFace-format directory (config.json, model.safetensors, tokenizer files) all or nothing
    (`atomic_io.atomic_dir`: built under a temporary name, swapped in when complete); with
    `quantization` (a scheme of quantize.py) the QWeights of hf_tensors as qweight/scales[/mins]."""
    from safetensors.torch import save_file

    config = args.to_hf_config()
    config["torch_dtype"] = "float32"
    if quantization:
        config["quantization_config"] = {"quant_method": QUANT_METHOD, **quantization, "format_version": 1}
        hf_tensors = flatten_qweights(hf_tensors)
    if tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    config["eos_token_id"] = tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else tokenizer.eos_ids
    tensors = {k: v.contiguous() for k, v in hf_tensors.items()}
    if args.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.write_hf_files(tmp)
        write_json(tmp / "config.json", config, indent=2)
