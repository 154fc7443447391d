"""Reading checkpoints into `model.Transformer`: HuggingFace directories, GGUF files, and the
engine's converted directories (which are HuggingFace directories: config.json + safetensors +
tokenizer files, so transformers can load them too).

All routes produce a HuggingFace-named state dict in rotate-half q/k layout, which
`engine_state_dict` renames and fuses (q|k|v, gate|up) for `model.py`.  A linear weight in it is a
float tensor or, for quantized checkpoints, a `kernels.qlinear.QWeight` (int8/int4 codes + fp16
scales): directories written by `python quantize.py` (config "quantization_config") and, with
weights="auto", the Q8_0 / Q4_0 / Q4_1 tensors of a GGUF file, repacked code for code (the
scales are the file's fp16 values; nothing is rounded again).  `build_model` swaps a
`QuantizedLinear` in for each of them.
"""
from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from atomic_io import atomic_dir, test_pause, write_json
from kernels.cpu import cpu_eager_ops, cpu_kernels_available, decode_attention, use_linear_kernel
from kernels.qlinear import QuantizedEmbedding, QuantizedLinear, QWeight, check_qweight, dequantize
from model import ModelArgs, Transformer, rope_inv_freq
from tokenizer import Tokenizer

WEIGHTS = ("auto", "float")   # load quantized weights as they are stored, or dequantize them
QUANT_METHOD = "kvpolicy-weight-only"


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or not something this engine can run."""


# --------------------------------------------------------------------------- safetensors

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


# --------------------------------------------------------------------------- quantized directories

def linear_weight_names(args: ModelArgs) -> list[str]:
    """HF names of the weights that are linear layers (the head: lm_head, or the tied embedding)."""
    names = [f"model.layers.{i}.{m}.weight" for i in range(args.n_layers)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"]


def read_quantization(q, where) -> dict:
    """The scheme of a "quantization_config" written by quantize.py; CheckpointError for any other."""
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CheckpointError(f"{where}: unknown quantization scheme {method!r}; this engine loads "
                              f"{QUANT_METHOD!r} (written by `python quantize.py`)")
    ok = (q.get("mode") in ("int8", "int4") and q.get("head") in ("int8", "int4", "float")
          and isinstance(q.get("group_size"), int) and isinstance(q.get("symmetric"), bool)
          and q.get("format_version") == 1)
    if not ok:
        raise CheckpointError(f"{where}: unknown quantization scheme {q}: expected mode int8|int4, head "
                              f"int8|int4|float, an int group_size, a bool symmetric, format_version 1")
    return {k: q[k] for k in ("mode", "group_size", "symmetric", "head")}


def collect_qweights(tensors: dict, args: ModelArgs, path) -> dict:
    """Replace each X.qweight / X.scales [/ X.mins] triple by a QWeight under X.weight (checked)."""
    out = {k: v for k, v in tensors.items() if not k.endswith((".qweight", ".scales", ".mins"))}
    for name in linear_weight_names(args):
        base = name[:-len(".weight")]
        if base + ".qweight" not in tensors:
            continue
        q, scales = tensors[base + ".qweight"], tensors.get(base + ".scales")
        bits = 8 if q.dtype == torch.int8 else 4
        if scales is None or scales.dim() != 2 or q.dim() != 2 or not scales.shape[1]:
            raise CheckpointError(f"{path}: corrupted quantized tensor {base}: qweight {tuple(q.shape)} without "
                                  f"matching scales")
        K = q.shape[1] * (8 // bits)
        mins = tensors.get(base + ".mins")
        if bits == 4 and mins is None:   # symmetric int4: min = -8 * scale (exact in fp16)
            mins = scales * -8
        qw = QWeight(q, scales, mins, bits, K // scales.shape[1])
        try:
            check_qweight(qw)
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupted quantized tensor {base}: {e}") from None
        out[name] = qw
    stray = sorted(k for k in tensors if k.endswith(".qweight") and k[:-8] + ".weight" not in out)
    if stray:
        raise CheckpointError(f"{path}: unexpected quantized tensor(s) {', '.join(stray[:3])}")
    return out


def flatten_qweights(tensors: dict) -> dict:
    """The inverse of collect_qweights: QWeight entries X.weight -> X.qweight, X.scales (and X.mins for
    asymmetric int4; a symmetric one's minimum is -8 * scale and is not written)."""
    out = {}
    for name, t in tensors.items():
        if not isinstance(t, QWeight):
            out[name] = t
            continue
        base = name[:-len(".weight")]
        out[base + ".qweight"], out[base + ".scales"] = t.qweight, t.scales
        if t.mins is not None and not torch.equal(t.mins, t.scales * -8):
            out[base + ".mins"] = t.mins
    return out


# --------------------------------------------------------------------------- GGUF

# GGUF tensor name -> HF name (per layer names use {i})
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.")


# --------------------------------------------------------------------------- GGUF layout, checked first

# The gguf reader trusts every count, length and offset in a file: an absurd array length makes it loop
# (and allocate) without end, a tensor offset past the end gives a short view.  scan_gguf walks the
# header first, checking each against the bytes that are really there, and decodes the metadata and
# tensor infos itself; read_gguf then reads each tensor's bytes into memory of its own (the reader's
# parse of the whole file held ~220 MB more than the tensors while loading the default model).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
GGUF_MAX_ITEMS = 1 << 21    # metadata array items per file (a 256k vocabulary's tokens + scores + types: 0.8M)
GGUF_MAX_DIMS = 4


class GGUFTensorInfo(NamedTuple):
    name: str
    dims: tuple        # GGUF order: the fastest-varying dimension first (HF shape = reversed)
    kind: int          # GGMLQuantizationType value
    offset: int        # from the start of the data section
    nbytes: int
    start: int = 0     # from the start of the file (set by scan_gguf)


class _Cursor:
    """Little-endian reads from a buffer that never go past its end (CheckpointError naming the field)."""

    def __init__(self, buf, path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file: {what} at byte {self.pos} needs "
                                  f"{n} bytes, the file has {self.size - self.pos} left")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, n: int, what: str) -> int:
        start = self.take(n, what)
        return int.from_bytes(self.buf[start:start + n], "little")

    def scalars(self, kind: int, n: int, what: str):
        dtype = np.dtype("<" + _GGUF_SCALARS[kind])
        start = self.take(n * dtype.itemsize, what)
        return np.frombuffer(self.buf, dtype, n, start)

    def text(self, what: str) -> str:
        n = self.uint(8, f"length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: corrupt GGUF file: {what} at byte {start} is not UTF-8") from None


def _gguf_value(c: _Cursor, kind: int, key: str, items: list):
    """One metadata value of type `kind` (counting array items in items[0])."""
    if kind in _GGUF_SCALARS:
        return c.scalars(kind, 1, key)[0].item()
    if kind == _GGUF_STRING:
        return c.text(key)
    if kind != _GGUF_ARRAY:
        raise CheckpointError(f"{c.path}: corrupt GGUF file: metadata {key} has unknown value type {kind}")
    item, n = c.uint(4, f"item type of {key}"), c.uint(8, f"length of {key}")
    items[0] += n
    if items[0] > GGUF_MAX_ITEMS:
        raise CheckpointError(f"{c.path}: corrupt GGUF file: metadata {key} has {n} items (more than the "
                              f"{GGUF_MAX_ITEMS} array items in all this engine reads)")
    if item in _GGUF_SCALARS:
        return c.scalars(item, n, f"{n} items of {key}").tolist()
    if item == _GGUF_STRING:
        c.take(n * 8, f"{n} strings of {key}")   # at least their lengths must be there
        c.pos -= n * 8
        return [c.text(f"{key}[{i}]") for i in range(n)]
    raise CheckpointError(f"{c.path}: corrupt GGUF file: metadata {key} is an array of unsupported type {item}")


def _gguf_metadata(c: _Cursor, n_kv: int) -> dict:
    """The n_kv metadata entries -> {key: value}; general.alignment checked."""
    meta, items = {}, [0]
    for i in range(n_kv):
        key = c.text(f"metadata key {i}")
        if key in meta:
            raise CheckpointError(f"{c.path}: corrupt GGUF file: duplicate metadata key {key[:80]}")
        kind = c.uint(4, f"value type of {key}")
        meta[key] = _gguf_value(c, kind, key, items)
        if key == "general.alignment" and (kind != _GGUF_UINT32 or not meta[key] or meta[key] & (meta[key] - 1)):
            raise CheckpointError(f"{c.path}: corrupt GGUF file: general.alignment must be a power of two "
                                  f"(UINT32), got {str(meta[key])[:40]} of type {kind}")
    return meta


def _gguf_tensor_info(c: _Cursor, i: int) -> GGUFTensorInfo:
    """One tensor-info entry, its dims and type checked."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = c.text(f"name of tensor {i}")
    n_dims = c.uint(4, f"dimension count of {name}")
    if not 1 <= n_dims <= GGUF_MAX_DIMS:
        raise CheckpointError(f"{c.path}: corrupt GGUF file: tensor {name} has {n_dims} dimensions (1 to {GGUF_MAX_DIMS})")
    dims = tuple(c.uint(8, f"dimension {d} of {name}") for d in range(n_dims))
    kind = c.uint(4, f"type of {name}")
    offset = c.uint(8, f"data offset of {name}")
    try:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise CheckpointError(f"{c.path}: corrupt GGUF file: tensor {name} has unknown type {kind}") from None
    count = math.prod(dims)
    if 0 in dims or count > c.size * block or dims[0] % block:
        raise CheckpointError(f"{c.path}: corrupt GGUF file: tensor {name} has impossible dimensions {list(dims)} "
                              f"for type {GGMLQuantizationType(kind).name} in a file of {c.size} bytes")
    return GGUFTensorInfo(name, dims, kind, offset, count // block * type_bytes)


def scan_gguf(path: Path) -> tuple[dict, list[GGUFTensorInfo]]:
    """(metadata, tensor infos) of the GGUF file at `path`, after checking its header (magic, version,
    counts, metadata, tensor infos, alignment, tensor data extents) against the file's size: CheckpointError
    naming the file and the field otherwise.  Reads the header only; allocates nothing a count decides
    before the bytes it counts are known to be there."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise CheckpointError(f"{path}: not a GGUF file ({size} bytes: truncated or empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, path)
            if buf[:4] != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
            c.take(4, "magic")
            version = c.uint(4, "version")
            if version not in (2, 3):
                kind = "a big-endian GGUF file (not supported)" if not version & 0xFFFF else f"GGUF version {version}"
                raise CheckpointError(f"{path}: {kind}; this engine reads little-endian GGUF versions 2 and 3")
            n_tensors, n_kv = c.uint(8, "tensor count"), c.uint(8, "metadata count")
            if n_kv > (size - c.pos) // 13 or n_tensors > (size - c.pos) // 32:
                raise CheckpointError(f"{path}: corrupt GGUF file: {n_kv} metadata entries and {n_tensors} tensors "
                                      f"cannot fit in {size} bytes")
            meta = _gguf_metadata(c, n_kv)
            infos = [_gguf_tensor_info(c, i) for i in range(n_tensors)]
    alignment = meta.get("general.alignment", 32)
    data_start = -(-c.pos // alignment) * alignment
    _check_gguf_extents(path, infos, data_start, size, alignment)
    return meta, [t._replace(start=data_start + t.offset) for t in infos]


def _check_gguf_extents(path, infos: list, data_start: int, size: int, alignment: int) -> None:
    """Tensor names unique, data offsets aligned, every tensor's bytes inside the file."""
    names = set()
    for name, _, _, offset, nbytes, _ in infos:
        if name in names:
            raise CheckpointError(f"{path}: corrupt GGUF file: duplicate tensor {name}")
        names.add(name)
        if offset % alignment:
            raise CheckpointError(f"{path}: corrupt GGUF file: tensor {name} starts at data offset {offset}, "
                                  f"not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > size:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF file: tensor {name} (bytes "
                                  f"{data_start + offset}..{data_start + offset + nbytes}) ends past the end of "
                                  f"the file ({size} bytes)")


def _gguf_number(meta: dict, key: str, where, kind=int, default=None):
    """The numeric GGUF field `key` as `kind` (its default when absent; CheckpointError if it is required and
    absent, or not a number of that kind)."""
    if key not in meta:
        if default is None:
            raise CheckpointError(f"{where}: GGUF metadata is missing required field {key}")
        return default
    value = meta[key]
    exact = isinstance(value, int) or (isinstance(value, float) and (kind is float or value.is_integer()))
    if isinstance(value, bool) or not exact:
        raise CheckpointError(f"{where}: GGUF field {key} = {str(value)[:40]} is not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def args_from_gguf(meta: dict, tensor_names: set[str], where="GGUF file") -> ModelArgs:
    """ModelArgs from a GGUF file's metadata (CheckpointError naming `where` and the field)."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "mistral"):
        raise CheckpointError(f"{where}: unsupported GGUF architecture {str(arch)[:40]!r}; supported: llama, mistral")

    def get(key, default=None, kind=int):
        return _gguf_number(meta, f"{arch}.{key}", where, kind, default)

    n_heads, dim = get("attention.head_count"), get("embedding_length")
    vocab = get("vocab_size", -1)
    if vocab == -1:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    head_dim = get("attention.key_length", 0) or get("rope.dimension_count", dim // max(n_heads, 1))
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor", kind=float)}
    window = get("attention.sliding_window", 0)
    try:
        return ModelArgs(
            vocab_size=vocab, dim=dim, n_layers=get("block_count"), n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads), intermediate_size=get("feed_forward_length"),
            head_dim=head_dim, norm_eps=get("attention.layer_norm_rms_epsilon", kind=float),
            rope_theta=get("rope.freq_base", 10000.0, float), rope_scaling=scaling,
            max_position_embeddings=get("context_length", 4096), tie_word_embeddings="output.weight" not in tensor_names,
            sliding_window=window or None, attention_bias="blk.0.attn_q.bias" in tensor_names)
    except ValueError as e:
        raise CheckpointError(f"{where}: GGUF metadata describes no valid model: {e}") from None


def _unpermute_gguf(w, n_heads: int):
    """GGUF stores q/k rows in interleaved-pair RoPE order; back to HF's rotate-half order (a row
    permutation: numpy arrays, tensors, and the code/scale rows of a QWeight alike)."""
    if isinstance(w, QWeight):
        return w.map(lambda t: _unpermute_gguf(t, n_heads))
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF block types repacked as they are: bytes per block of 32 weights
_GGUF_NATIVE = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def gguf_qweight(t) -> QWeight:
    """A Q8_0 / Q4_0 / Q4_1 GGUF tensor as a QWeight of groups of 32, code for code:
    Q8_0 block = fp16 d, 32 int8 q (w = d q); Q4_0 = fp16 d, 16 bytes (w = d (q - 8)); Q4_1 = fp16 d,
    fp16 m, 16 bytes (w = d q + m), byte j holding q[j] in its low nibble and q[j + 16] in its high one."""
    kind = t.tensor_type.name
    raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8))
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _GGUF_NATIVE[kind])                      # [N, K/32, bytes]
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]           # [N, K/32]
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        return QWeight(q, d, None, 8, 32)
    nib = blocks[..., 4 if kind == "Q4_1" else 2:]                          # [N, K/32, 16]
    codes = torch.cat((nib & 15, nib >> 4), dim=-1).reshape(rows, -1)      # q[j], then q[j + 16]
    from kernels.qlinear import pack_int4
    mins = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if kind == "Q4_1" else d * -8
    return QWeight(pack_int4(codes), d, mins, 4, 32)


def dequantize_gguf_tensor(t, where="GGUF file") -> np.ndarray:
    """A GGUF tensor as float32 numpy in (rows, cols) order; clear error for unknown types."""
    import gguf

    kind = t.tensor_type
    try:
        return gguf.quants.dequantize(t.data, kind).astype(np.float32, copy=False)
    except (NotImplementedError, KeyError) as e:
        raise CheckpointError(f"{where}: tensor {t.name}: GGUF type {kind.name} cannot be dequantized "
                              f"by this engine") from e


def _gguf_hf_name(name: str, where) -> tuple[str, str]:
    """GGUF tensor name -> (its _GGUF_NAMES key, the HF name); CheckpointError for a name no llama has."""
    m = _GGUF_LAYER.match(name)
    key = name.replace(m.group(0), "blk.{i}.", 1) if m else name
    if key not in _GGUF_NAMES:
        raise CheckpointError(f"{where}: unexpected tensor {name[:80]} for a llama model")
    return key, _GGUF_NAMES[key].format(i=m.group(1) if m else "")


def _rope_factors(t, args: ModelArgs, where) -> list[float]:
    """rope_freqs.weight (Llama 3.1 GGUFs carry the rope scaling as a tensor): positive finite divisors."""
    want = (args.head_dim // 2,)
    if t.tensor_type.name not in ("F32", "F16") or tuple(t.shape.tolist()) != want:
        raise CheckpointError(f"{where}: rope_freqs.weight must be F32/F16 {list(want)}, got "
                              f"{t.tensor_type.name} {t.shape.tolist()}")
    factors = np.asarray(t.data, np.float32)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise CheckpointError(f"{where}: rope_freqs.weight holds factors that are not positive finite numbers")
    return factors.tolist()


def _gguf_tensor(t, key: str, args: ModelArgs, native: bool, where):
    """One GGUF tensor (shape already checked against the config) as a float tensor or, for native
    Q8_0/Q4_0/Q4_1 linear weights, a QWeight; q/k rows back in rotate-half order."""
    linear = key.endswith(".weight") and "norm" not in key and (key != "token_embd.weight" or args.tie_word_embeddings)
    if native and linear and t.tensor_type.name in _GGUF_NATIVE:
        w = gguf_qweight(t)
    else:
        w = dequantize_gguf_tensor(t, where)
    if key.startswith("blk.{i}.attn_q."):
        w = _unpermute_gguf(w, args.n_heads)
    elif key.startswith("blk.{i}.attn_k."):
        w = _unpermute_gguf(w, args.n_kv_heads)
    return w if isinstance(w, QWeight) else torch.from_numpy(np.require(w, requirements=["C", "W"]))


def inspect_gguf(path: Path) -> tuple[ModelArgs, dict, list[GGUFTensorInfo]]:
    """(ModelArgs, metadata, tensor infos) of a .gguf file whose layout, metadata and tensor shapes are all
    checked (`scan_gguf`, `args_from_gguf`, `check_config`); reads no tensor data."""
    meta, infos = scan_gguf(path)
    by_name = {t.name: t for t in infos}
    args = args_from_gguf(meta, set(by_name), path)
    rope = by_name.pop("rope_freqs.weight", None)
    if rope is not None and (rope.kind not in (0, 1) or rope.dims != (args.head_dim // 2,)):
        raise CheckpointError(f"{path}: rope_freqs.weight must be F32/F16 [{args.head_dim // 2}], got type "
                              f"{rope.kind} {list(rope.dims)}")
    shapes = {_gguf_hf_name(name, path)[1]: tuple(reversed(t.dims)) for name, t in by_name.items()}
    check_config(args, shapes, path)
    return args, meta, infos


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, read: float/int types as numpy arrays of their dtype, block types as
    bytes [rows, bytes per row] (both in HF shape order, as gguf-py's reader gives them)."""
    name: str
    tensor_type: object     # gguf.GGMLQuantizationType
    shape: np.ndarray       # GGUF order
    data: np.ndarray


_GGUF_ITEMS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


def read_gguf_tensor(f, info: GGUFTensorInfo) -> GGUFTensor:
    """The bytes of one tensor (its extent checked by scan_gguf) from the open file f."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    kind = GGMLQuantizationType(info.kind)
    raw = np.empty(info.nbytes, np.uint8)
    f.seek(info.start)
    if f.readinto(raw) != info.nbytes:
        raise CheckpointError(f"{f.name}: truncated while reading tensor {info.name} (the file changed)")
    shape = list(reversed(info.dims))
    if kind.name in _GGUF_ITEMS:
        data = raw.view(_GGUF_ITEMS[kind.name]).reshape(shape)
    else:
        block, type_bytes = GGML_QUANT_SIZES[kind]
        data = raw.reshape(*shape[:-1], shape[-1] // block * type_bytes)
    return GGUFTensor(info.name, kind, np.array(info.dims), data)


def read_gguf(path: Path, native: bool = False, inspected: Optional[tuple] = None):
    """(ModelArgs, HF-named float32 tensors) of a .gguf file, checked first (`inspect_gguf`, unless its
    result is given as `inspected`); native=True keeps the Q8_0/Q4_0/Q4_1 linear weights (and a tied
    embedding) as QWeights (`gguf_qweight`).  Tensors are read and converted one at a time."""
    from gguf.constants import GGMLQuantizationType
    args, _, infos = inspected or inspect_gguf(path)
    by_name = {t.name: t for t in infos}
    names = {name: _gguf_hf_name(name, path) for name in by_name if name != "rope_freqs.weight"}
    args.gguf_quantized = any(GGMLQuantizationType(t.kind).name in _GGUF_NATIVE for t in infos)
    with open(path, "rb") as f:
        if "rope_freqs.weight" in by_name:
            factors = _rope_factors(read_gguf_tensor(f, by_name["rope_freqs.weight"]), args, path)
            args.rope_scaling = {"rope_type": "freq_factors", "factors": factors}
            _check_rope(args, path)
        tensors = {}
        for name, (key, hf) in names.items():
            tensors[hf] = _gguf_tensor(read_gguf_tensor(f, by_name[name]), key, args, native, path)
            release_freed_memory()      # the bytes read and the repacking's temporaries
    return args, tensors


# --------------------------------------------------------------------------- to model.py

def cat_rows(parts: list):
    """Concatenate weights along the output rows: float tensors, or QWeights of one format (exact);
    a mix is dequantized to fp32 first."""
    if not any(isinstance(p, QWeight) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    same = all(isinstance(p, QWeight) and (p.bits, p.group, p.mins is None) == (first.bits, first.group, first.mins is None)
               for p in parts)
    if not same:
        return torch.cat([dequantize(p) if isinstance(p, QWeight) else p.float() for p in parts])
    cat = lambda attr: None if first.mins is None and attr == "mins" else torch.cat([getattr(p, attr) for p in parts])
    return QWeight(cat("qweight"), cat("scales"), cat("mins"), first.bits, first.group)


def expected_shapes(args: ModelArgs) -> dict[str, tuple]:
    """HF name -> shape of every tensor a model with these args has (the head only when untied)."""
    D, F, V = args.dim, args.intermediate_size, args.vocab_size
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
                       p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,)})
        if args.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _ignored_tensor(name: str, args: ModelArgs) -> bool:
    """Tensors some checkpoints carry that the model does not use (RoPE buffers, a tied head's copy)."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and args.tie_word_embeddings)


def check_config(args: ModelArgs, shapes: dict, where) -> None:
    """CheckpointError unless the checkpoint's tensors (HF name -> shape) are exactly the ones the config
    describes, and its RoPE settings give finite frequencies.  Runs before any model is built, so a
    corrupt layer count or dimension never allocates."""
    if args.n_layers * 9 > len(shapes):
        raise CheckpointError(f"{where}: the config describes {args.n_layers} layers, the checkpoint holds only "
                              f"{len(shapes)} tensors")
    want = expected_shapes(args)
    missing = [name for name in want if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: checkpoint is missing tensor {missing[0]}{more}")
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(shapes[name])}, the config needs {list(shape)}")
    extra = sorted(name for name in shapes if name not in want and not _ignored_tensor(name, args))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {', '.join(extra[:3])} (not part of the "
                              f"{args.n_layers}-layer model the config describes)")
    _check_rope(args, where)


def _check_rope(args: ModelArgs, where) -> None:
    """CheckpointError unless the RoPE settings give finite frequencies (a bad scaling dict fails here,
    not when the first request sets up its cache)."""
    try:
        inv_freq = rope_inv_freq(args)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, RuntimeError) as e:
        raise CheckpointError(f"{where}: invalid RoPE scaling {str(args.rope_scaling)[:80]} ({type(e).__name__}: "
                              f"{e})") from None
    if not torch.isfinite(inv_freq).all():
        raise CheckpointError(f"{where}: RoPE theta {args.rope_theta} with scaling {str(args.rope_scaling)[:80]} "
                              f"gives non-finite frequencies")


def release_freed_memory() -> None:
    """Hand the heap memory freed since the last call back to the OS.  glibc keeps it otherwise, and
    the loader frees as much as it builds (unfused weights, row-major codes): trimming after each layer
    keeps the load's peak at the model's size (fp32 default model: peak +578 MB, not +669).  A no-op
    where there is no glibc."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes
    return ctypes.CDLL("libc.so.6")


def engine_state_dict(args: ModelArgs, hf: dict, consume: bool = False) -> dict:
    """Rename HF tensors to model.py's names, fusing q|k|v and gate|up (float tensors or QWeights);
    consume=True pops them from `hf` (the unfused parts are freed as soon as they are fused)."""
    def take(name):
        if name not in hf:
            raise CheckpointError(f"checkpoint is missing tensor {name}")
        return hf.pop(name) if consume else hf[name]

    sd = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
          "norm.weight": take("model.norm.weight")}
    if not args.tie_word_embeddings:
        sd["output.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        attn = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        sd[a + "attention.wqkv.weight"] = cat_rows(attn)
        if args.attention_bias:
            sd[a + "attention.wqkv.bias"] = torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        sd[a + "attention.wo.weight"] = take(f"{p}self_attn.o_proj.weight")
        sd[a + "feed_forward.w13.weight"] = cat_rows([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")])
        sd[a + "feed_forward.w2.weight"] = take(f"{p}mlp.down_proj.weight")
        sd[a + "attention_norm.weight"] = take(f"{p}input_layernorm.weight")
        sd[a + "ffn_norm.weight"] = take(f"{p}post_attention_layernorm.weight")
        if consume:
            del attn
            release_freed_memory()
    return sd


class on_meta(torch.overrides.TorchFunctionMode):
    """Construct modules on the meta device without their random initialisation (the checkpoint
    overwrites every parameter): torch's meta `normal_` / `uniform_` import torch._dynamo, which
    costs an eager process ~150 MB of memory."""
    INIT = {"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_"}

    def __enter__(self):
        self.device = torch.device("meta")
        self.device.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.device.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.INIT and getattr(func, "__module__", "") == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(args: ModelArgs, hf_tensors: dict, device, dtype: torch.dtype, consume: bool = False) -> Transformer:
    """Construct on the meta device, then assign the (cast) checkpoint tensors; every QWeight becomes a
    QuantizedLinear (a tied quantized head also serves the embedding lookups).  consume=True empties
    `hf_tensors` on the way, so a quantized checkpoint is never held in two layouts at once."""
    with on_meta():
        model = Transformer(args)
    sd = engine_state_dict(args, hf_tensors, consume)
    if args.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    elif isinstance(sd["tok_embeddings.weight"], QWeight):   # an untied table is only looked up
        sd["tok_embeddings.weight"] = dequantize(sd["tok_embeddings.weight"])
    if isinstance(sd["tok_embeddings.weight"], QWeight):
        del sd["tok_embeddings.weight"]                      # tied: the head's QuantizedLinear serves it
    quantized = [k[:-len(".weight")] for k, v in sd.items() if isinstance(v, QWeight)]
    for name in quantized:
        qw = sd.pop(name + ".weight").map(lambda t: t.to(device))
        bias = sd.pop(name + ".bias", None)
        try:
            layer = QuantizedLinear(qw, None if bias is None else bias.to(device=device, dtype=dtype))
        except ValueError as e:
            raise CheckpointError(f"quantized weight {name}: {e}") from e
        del qw
        release_freed_memory()
        if (layer.out_features, layer.in_features) != tuple(model.get_submodule(name).weight.shape):
            raise CheckpointError(f"quantized weight {name} is {(layer.out_features, layer.in_features)}, the "
                                  f"config needs {tuple(model.get_submodule(name).weight.shape)}")
        model.set_submodule(name, layer)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    for name in quantized:
        sd.update({f"{name}.{k}": v for k, v in model.get_submodule(name).state_dict().items()})
    if args.tie_word_embeddings and "output" in quantized:
        model.tok_embeddings = QuantizedEmbedding(model.output, dtype)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint does not fit the config: {e}") from e
    if args.tie_word_embeddings and "output" not in quantized:
        model.output.weight = model.tok_embeddings.weight
    if torch.device(device).type == "cpu":
        cpu_kernels_available()                   # build/load now, not inside a torch.compile trace
        use_linear_kernel(model)                  # the C++ decode-sized fp32 linear layers
    model.decode_kernel = decode_attention        # the C++ kernel on CPU (grouped_attention elsewhere)
    model.use_ops(cpu_eager_ops())                # fewer, larger ops in eager CPU steps
    return model.eval()


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
        test_pause("converted weights")
        tokenizer.write_hf_files(tmp)
        write_json(tmp / "config.json", config, indent=2)
