"""GGUF files: the header walked and checked against the file's size (`scan_gguf`), ModelArgs from the
metadata, each tensor read into memory of its own and converted to HF names and rotate-half q/k rows
(float32, or with native=True the Q8_0 / Q4_0 / Q4_1 linear weights repacked code for code as QWeights)."""
from __future__ import annotations

import math
import mmap
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from checkpoint.check import CheckpointError, check_config, check_rope
from checkpoint.memory import release_freed_memory
from kernels.qlinear import QWeight
from model import ModelArgs


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
            sliding_window=window or None, attention_bias="blk.0.attn_q.bias" in tensor_names, model_type=arch)
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
            check_rope(args, path)
        tensors = {}
        for name, (key, hf) in names.items():
            tensors[hf] = _gguf_tensor(read_gguf_tensor(f, by_name[name]), key, args, native, path)
            release_freed_memory()      # the bytes read and the repacking's temporaries
    return args, tensors
