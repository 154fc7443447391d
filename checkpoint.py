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

import json
import mmap
import os
import re
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from kernels.cpu import cpu_kernels_available, decode_attention, fuse_norms
from kernels.qlinear import QuantizedEmbedding, QuantizedLinear, QWeight, check_qweight, dequantize
from model import ModelArgs, Transformer
from tokenizer import Tokenizer

WEIGHTS = ("auto", "float")   # load quantized weights as they are stored, or dequantize them
QUANT_METHOD = "kvpolicy-weight-only"


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or not something this engine can run."""


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
              "I8": torch.int8}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one .safetensors file, memory-mapped (copy-on-write) instead of read."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + header_len > size:
                raise CheckpointError(f"{path}: truncated safetensors file (header says {header_len} bytes)")
            header = json.loads(f.read(header_len))
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + header_len else b""
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > size:
            raise CheckpointError(f"{path}: truncated (tensor {name} ends past the end of the file)")
        dtype = _ST_DTYPES[info["dtype"]]
        count = (end - start) // dtype.itemsize
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"])
    return tensors


def read_hf_dir(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """ModelArgs and HF-named tensors of a HuggingFace (or converted) model directory."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a HuggingFace model directory)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: invalid JSON ({e})") from e
    try:
        args = ModelArgs.from_hf_config(config)
    except ValueError as e:
        raise CheckpointError(f"{config_path}: {e}") from e
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # ValueError: bad JSON/UTF-8
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from e
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights (PyTorch .bin files are not supported)")
    tensors = {}
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: weight file {name} listed in the index is missing")
        tensors.update(read_safetensors(path / name))
    if "quantization_config" in config:
        args.quantization = read_quantization(config["quantization_config"], config_path)
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


def gguf_metadata(reader) -> dict:
    """All GGUF key/value fields as Python values (large token arrays included)."""
    meta = {}
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = fld.contents()
    return meta


def args_from_gguf(meta: dict, tensor_names: set[str]) -> ModelArgs:
    arch = meta.get("general.architecture")
    if arch not in ("llama", "mistral"):
        raise CheckpointError(f"unsupported GGUF architecture {arch!r}; supported: llama, mistral")

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise CheckpointError(f"GGUF metadata is missing required field {full}")
            return default
        return meta[full]

    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    vocab = get("vocab_size", None, required=False)
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    head_dim = get("attention.key_length", None, required=False) or get("rope.dimension_count", dim // n_heads, required=False)
    scaling = None
    if get("rope.scaling.type", "none", required=False) == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return ModelArgs(
        vocab_size=int(vocab), dim=dim, n_layers=int(get("block_count")), n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads, required=False)),
        intermediate_size=int(get("feed_forward_length")), head_dim=int(head_dim),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0, required=False)), rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096, required=False)),
        tie_word_embeddings="output.weight" not in tensor_names,
        sliding_window=get("attention.sliding_window", None, required=False),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


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
    with warnings.catch_warnings():   # a read-only view of the file: only read (the results are new tensors)
        warnings.simplefilter("ignore", UserWarning)
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


def dequantize_gguf_tensor(t) -> np.ndarray:
    """A GGUF tensor as float32 numpy in (rows, cols) order; clear error for unknown types."""
    import gguf

    kind = t.tensor_type
    try:
        return gguf.quants.dequantize(t.data, kind).astype(np.float32, copy=False)
    except (NotImplementedError, KeyError) as e:
        raise CheckpointError(f"tensor {t.name}: GGUF type {kind.name} cannot be dequantized "
                              f"by this engine") from e


def read_gguf(path: Path, native: bool = False):
    """(ModelArgs, HF-named float32 tensors, open GGUFReader) of a .gguf file; native=True keeps the
    Q8_0/Q4_0/Q4_1 linear weights (and a tied embedding) as QWeights (`gguf_qweight`)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on truncated/corrupt files
        raise CheckpointError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from e
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    args = args_from_gguf(meta, names)
    if "rope_freqs.weight" in names:  # Llama 3.1 GGUFs carry the rope scaling as a tensor
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        args.rope_scaling = {"rope_type": "freq_factors", "factors": np.asarray(factors.data, np.float32).tolist()}
    tensors = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        m = _GGUF_LAYER.match(t.name)
        key = t.name.replace(m.group(0), "blk.{i}.") if m else t.name
        if key not in _GGUF_NAMES:
            raise CheckpointError(f"{path}: unexpected tensor {t.name} for a llama model")
        linear = key.endswith(".weight") and "norm" not in key and (key != "token_embd.weight" or args.tie_word_embeddings)
        args.gguf_quantized = getattr(args, "gguf_quantized", False) or t.tensor_type.name in _GGUF_NATIVE
        if native and linear and t.tensor_type.name in _GGUF_NATIVE:
            w = gguf_qweight(t)
        else:
            w = dequantize_gguf_tensor(t)
        if key.startswith("blk.{i}.attn_q."):
            w = _unpermute_gguf(w, args.n_heads)
        elif key.startswith("blk.{i}.attn_k."):
            w = _unpermute_gguf(w, args.n_kv_heads)
        hf_name = _GGUF_NAMES[key].format(i=m.group(1) if m else "")
        tensors[hf_name] = w if isinstance(w, QWeight) else torch.from_numpy(np.require(w, requirements=["C", "W"]))
    return args, tensors, reader


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
    return sd


def build_model(args: ModelArgs, hf_tensors: dict, device, dtype: torch.dtype, consume: bool = False) -> Transformer:
    """Construct on the meta device, then assign the (cast) checkpoint tensors; every QWeight becomes a
    QuantizedLinear (a tied quantized head also serves the embedding lookups).  consume=True empties
    `hf_tensors` on the way, so a quantized checkpoint is never held in two layouts at once."""
    with torch.device("meta"):
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
    model.decode_kernel = decode_attention        # the C++ kernel on CPU (grouped_attention elsewhere)
    fuse_norms(model)                             # one op per RMSNorm in eager CPU steps
    return model.eval()


def read_checkpoint(path, weights: str = "float") -> tuple[ModelArgs, dict, Tokenizer]:
    """(args, HF-named tensors, tokenizer) for a .gguf file or a model directory.  weights="float":
    every weight a float tensor (quantized ones dequantized to fp32); "auto": quantized weights
    as QWeights (quantized directories; GGUF Q8_0/Q4_0/Q4_1 linear weights)."""
    if weights not in WEIGHTS:
        raise CheckpointError(f"unknown --weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    as_float = (lambda t: {k: dequantize(v) if isinstance(v, QWeight) else v for k, v in t.items()}) \
        if weights == "float" else (lambda t: t)
    try:
        if path.is_dir():
            args, tensors = read_hf_dir(path)
            return args, as_float(tensors), Tokenizer.from_dir(path)
        if path.suffix == ".gguf":
            args, tensors, reader = read_gguf(path, native=weights == "auto")
            return args, tensors, Tokenizer.from_gguf(reader)
    except (ValueError, FileNotFoundError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(str(e)) from e  # tokenizer problems are checkpoint problems
    raise CheckpointError(f"{path}: expected a model directory or a .gguf file")


def write_converted_dir(out: Path, args: ModelArgs, hf_tensors: dict, tokenizer,
                        quantization: Optional[dict] = None) -> None:
    """Write a HuggingFace-format directory (config.json, model.safetensors, tokenizer files); with
    `quantization` (a scheme of quantize.py) the QWeights of hf_tensors as qweight/scales[/mins]."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
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
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.write_hf_files(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
