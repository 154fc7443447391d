"""checkpoint/: GGUF dequantization of every supported type (against independent reference
decoders written here from the ggml block layouts), q/k un-permutation, logits against
transformers, sharded and memory-mapped safetensors, clear errors on corrupt checkpoints, and
scripts/convert_checkpoint.py.

Tiny GGUF files are written with `gguf.GGUFWriter`.  Types that `gguf.quants.quantize` supports
are quantized from known float weights; Q4_K and Q6_K (no numpy quantizer) are packed here from
known integer fields (scales, mins, quants) and a known fp16 super-block scale.
"""
import json
import os
import subprocess
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as QT

from checkpoint import (CheckpointError, build_model, read_checkpoint, read_gguf, read_hf_dir,
                        read_safetensors, scan_gguf)
from tokenizer import BYTE_TO_UNICODE, Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


# --------------------------------------------------------------------------- reference decoders
# Written from ggml's block structs (ggml-common.h) and dequantize_row_* (ggml-quants.c), without
# using gguf.quants, so a wrong dequantizer in the engine's path cannot agree with them by accident.

def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from a [n, 2] uint8 array -> float32 [n]."""
    return np.ascontiguousarray(b).view("<f2")[:, 0].astype(np.float32)


def ref_q8_0(raw: np.ndarray) -> np.ndarray:  # block_q8_0: fp16 d, int8 qs[32]
    b = raw.reshape(-1, 34)
    d, q = _f16(b[:, :2]), np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
    return (d[:, None] * q).reshape(raw.shape[0], -1)


def ref_q4_0(raw: np.ndarray) -> np.ndarray:  # block_q4_0: fp16 d, qs[16]; x[j]=lo nibble, x[j+16]=hi
    b = raw.reshape(-1, 18)
    d, qs = _f16(b[:, :2]), b[:, 2:].astype(np.int32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1) - 8
    return (d[:, None] * q).reshape(raw.shape[0], -1)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:  # block_q4_1: fp16 d, fp16 m, qs[16]; x = d*q + m
    b = raw.reshape(-1, 20)
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:].astype(np.int32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    return (d[:, None] * q + m[:, None]).reshape(raw.shape[0], -1)


def ref_q4_k(raw: np.ndarray) -> np.ndarray:
    """block_q4_K: fp16 d, fp16 dmin, scales[12] (6-bit scales/mins), qs[128]; 256 values."""
    b = raw.reshape(-1, 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, qs = b[:, 4:16].astype(np.int32), b[:, 16:].astype(np.int32)

    def get_scale_min_k4(j):
        if j < 4:
            return sc[:, j] & 63, sc[:, j + 4] & 63
        return ((sc[:, j + 4] & 0xF) | ((sc[:, j - 4] >> 6) << 4),
                (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4))

    y = np.empty((b.shape[0], 256), np.float32)
    for c in range(4):  # 64 values per iteration: low nibbles then high nibbles of qs[32c:32c+32]
        s1, m1 = get_scale_min_k4(2 * c)
        s2, m2 = get_scale_min_k4(2 * c + 1)
        q = qs[:, 32 * c:32 * c + 32]
        y[:, 64 * c:64 * c + 32] = (d * s1)[:, None] * (q & 0xF) - (dmin * m1)[:, None]
        y[:, 64 * c + 32:64 * c + 64] = (d * s2)[:, None] * (q >> 4) - (dmin * m2)[:, None]
    return y.reshape(raw.shape[0], -1)


def ref_q6_k(raw: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], int8 scales[16], fp16 d; 256 values."""
    b = raw.reshape(-1, 210)
    ql, qh = b[:, :128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    y = np.empty((b.shape[0], 256), np.float32)
    for h in range(2):  # 128 values per iteration
        L, H, S, o = ql[:, 64 * h:64 * h + 64], qh[:, 32 * h:32 * h + 32], sc[:, 8 * h:8 * h + 8], 128 * h
        for l in range(32):
            i = l // 16
            q1 = ((L[:, l] & 0xF) | (((H[:, l] >> 0) & 3) << 4)) - 32
            q2 = ((L[:, l + 32] & 0xF) | (((H[:, l] >> 2) & 3) << 4)) - 32
            q3 = ((L[:, l] >> 4) | (((H[:, l] >> 4) & 3) << 4)) - 32
            q4 = ((L[:, l + 32] >> 4) | (((H[:, l] >> 6) & 3) << 4)) - 32
            y[:, o + l] = d * S[:, i] * q1
            y[:, o + l + 32] = d * S[:, i + 2] * q2
            y[:, o + l + 64] = d * S[:, i + 4] * q3
            y[:, o + l + 96] = d * S[:, i + 6] * q4
    return y.reshape(raw.shape[0], -1)


REF_DECODERS = {QT.Q8_0: ref_q8_0, QT.Q4_0: ref_q4_0, QT.Q4_1: ref_q4_1, QT.Q4_K: ref_q4_k, QT.Q6_K: ref_q6_k}


# --------------------------------------------------------------------------- K-quant packers
# Known integer fields -> block bytes (inverse of the layouts above), and the values those fields
# mean, computed straight from the fields (y = d*sc*q - dmin*m per 32-value sub-block for Q4_K,
# y = d*sc*(q-32) per 16-value sub-block for Q6_K).

def pack_q4_k(d, dmin, sc, mn, q):
    """d, dmin: fp16 [n]; sc, mn: [n, 8] in 0..63; q: [n, 256] in 0..15 -> bytes [n, 144], values [n, 256]."""
    n = len(d)
    out = np.zeros((n, 144), np.uint8)
    out[:, 0:2] = d.astype("<f2").reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin.astype("<f2").reshape(n, 1).view(np.uint8)
    out[:, 4:8] = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
    out[:, 8:12] = (mn[:, :4] | ((mn[:, 4:] >> 4) << 6)).astype(np.uint8)
    out[:, 12:16] = ((sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)).astype(np.uint8)
    for c in range(4):
        out[:, 16 + 32 * c:48 + 32 * c] = (q[:, 64 * c:64 * c + 32] | (q[:, 64 * c + 32:64 * c + 64] << 4)).astype(np.uint8)
    sub = np.arange(256) // 32
    values = (d.astype(np.float32)[:, None] * sc[:, sub] * q - dmin.astype(np.float32)[:, None] * mn[:, sub])
    return out, values.astype(np.float32)


def pack_q6_k(d, sc, q):
    """d: fp16 [n]; sc: int8 [n, 16]; q: [n, 256] in 0..63 -> bytes [n, 210], values [n, 256]."""
    n = len(d)
    out = np.zeros((n, 210), np.uint8)
    for h in range(2):
        Q = q[:, 128 * h:128 * h + 128]
        q1, q2, q3, q4 = Q[:, 0:32], Q[:, 32:64], Q[:, 64:96], Q[:, 96:128]
        out[:, 64 * h:64 * h + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        out[:, 64 * h + 32:64 * h + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        out[:, 128 + 32 * h:160 + 32 * h] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.astype("<f2").reshape(n, 1).view(np.uint8)
    values = d.astype(np.float32)[:, None] * sc[:, np.arange(256) // 16].astype(np.float32) * (q - 32)
    return out, values.astype(np.float32)


def random_q4_k(rng, rows, cols):
    n = rows * cols // 256
    d = rng.uniform(1e-4, 3e-4, n).astype(np.float16)
    dmin = rng.uniform(5e-4, 2e-3, n).astype(np.float16)
    raw, values = pack_q4_k(d, dmin, rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8)),
                            rng.integers(0, 16, (n, 256)))
    return raw.reshape(rows, -1), values.reshape(rows, cols)


def random_q6_k(rng, rows, cols):
    n = rows * cols // 256
    d = rng.uniform(2e-5, 6e-5, n).astype(np.float16)
    raw, values = pack_q6_k(d, rng.integers(-128, 128, (n, 16)), rng.integers(0, 64, (n, 256)))
    return raw.reshape(rows, -1), values.reshape(rows, cols)


def test_reference_kquant_decoders_agree_with_field_values():
    """The packers and the reference decoders are two readings of the same spec: they must agree,
    including the 6-bit scale/min packing of sub-blocks 4..7 and Q6_K's negative scales."""
    rng = np.random.default_rng(1)
    raw, values = random_q4_k(rng, 8, 512)
    np.testing.assert_allclose(ref_q4_k(raw), values, rtol=1e-6, atol=1e-7)
    raw, values = random_q6_k(rng, 8, 512)
    np.testing.assert_allclose(ref_q6_k(raw), values, rtol=1e-6, atol=1e-7)
    # a hand-checked block: d=1, dmin=0.5, scale j = j+1 (j >= 4 uses the split encoding), min j = 40+j
    q = np.arange(256) % 16
    raw, _ = pack_q4_k(np.array([1.0], np.float16), np.array([0.5], np.float16),
                       np.arange(1, 9)[None], np.arange(40, 48)[None], q[None])
    y = ref_q4_k(raw)[0]
    assert y[0] == 1 * 0 - 0.5 * 40 and y[33] == 2 * 1 - 0.5 * 41 and y[255] == 8 * 15 - 0.5 * 47
    raw, _ = pack_q6_k(np.array([0.5], np.float16), (np.arange(16) - 8)[None], (np.arange(256) % 64)[None])
    y = ref_q6_k(raw)[0]
    assert y[0] == 0.5 * -8 * -32 and y[17] == 0.5 * -7 * (17 - 32) and y[255] == 0.5 * 7 * (63 - 32)


# --------------------------------------------------------------------------- tiny GGUF writer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab():
    """A gpt2-style byte-level vocab: 256 byte tokens, 3 merges, 3 control tokens."""
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)] + ["Ġt", "he", "Ġthe"] + SPECIALS
    types = [1] * 259 + [3] * 3
    merges = ["Ġ t", "h e", "Ġt he"]
    return tokens, types, merges


def permute_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (rotate-half rows -> interleaved pairs).

    Applied to whatever 2-D array is stored (floats, or quantized bytes of whole rows): quantization
    is row-wise, so permuting quantized rows is the same as quantizing permuted float rows."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(path: Path, tensors: dict, *, dim, n_layers, n_heads, n_kv_heads, ff, arch="llama",
               skip=(), vocab=None):
    """tensors: GGUF name -> (array, raw_dtype or None).  `skip`: metadata keys to leave out."""
    tokens, types, merges = vocab or tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    kv = {
        "block_count": lambda: w.add_block_count(n_layers),
        "context_length": lambda: w.add_context_length(256),
        "embedding_length": lambda: w.add_embedding_length(dim),
        "feed_forward_length": lambda: w.add_feed_forward_length(ff),
        "attention.head_count": lambda: w.add_head_count(n_heads),
        "attention.head_count_kv": lambda: w.add_head_count_kv(n_kv_heads),
        "attention.layer_norm_rms_epsilon": lambda: w.add_layer_norm_rms_eps(1e-5),
        "rope.freq_base": lambda: w.add_rope_freq_base(10000.0),
        "rope.dimension_count": lambda: w.add_rope_dimension_count(dim // n_heads),
    }
    for key, add in kv.items():
        if key not in skip:
            add()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_name(gguf_name: str) -> str:
    layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    base = gguf_name.removesuffix(".weight")
    if base in top:
        return top[base] + ".weight"
    _, i, kind = base.split(".")
    return f"model.layers.{i}.{layer[kind]}.weight"


# Mixed-type model: dims are multiples of 256 (K-quant super-blocks); every required type appears,
# q/k in four different types so the un-permutation is checked on floats and on quantized rows.
MIXED = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ff=512)
MIXED_TYPES = {
    "token_embd.weight": "F16", "output.weight": "BF16", "output_norm.weight": "F32",
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q6_K", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q4_0", "blk.0.ffn_gate.weight": "Q4_1", "blk.0.ffn_up.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.attn_q.weight": "Q8_0", "blk.1.attn_k.weight": "F16", "blk.1.attn_v.weight": "Q4_1",
    "blk.1.attn_output.weight": "BF16", "blk.1.ffn_gate.weight": "F32", "blk.1.ffn_up.weight": "Q4_0",
    "blk.1.ffn_down.weight": "Q8_0",
}
REQUIRED_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _shape(name, dim, n_layers, n_heads, n_kv_heads, ff, vocab):
    kind = name.split(".")[-2]
    kv = dim // n_heads * n_kv_heads
    return {"token_embd": (vocab, dim), "output": (vocab, dim), "output_norm": (dim,),
            "attn_norm": (dim,), "ffn_norm": (dim,), "attn_q": (dim, dim), "attn_k": (kv, dim),
            "attn_v": (kv, dim), "attn_output": (dim, dim), "ffn_gate": (ff, dim), "ffn_up": (ff, dim),
            "ffn_down": (dim, ff)}[kind]


def build_tiny_gguf(path: Path, types: dict, cfg: dict, seed=0, **write_kw):
    """Write a tiny llama GGUF; return {HF name: dict(type, original, expected, stored)}.

    original: the float weights in HF (rotate-half) layout the file encodes (for quantized types the
    floats that were quantized; for K-quants the exact values of the packed fields);
    expected: what a correct loader returns (reference-decoded, HF layout)."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])
    tensors, truth = {}, {}
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(cfg["n_layers"]):
        names += [f"blk.{i}.{k}.weight" for k in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v",
                                                   "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    for name in names:
        if name not in types:
            continue
        kind, shape = types[name], _shape(name, vocab=vocab, **cfg)
        if len(shape) == 1:  # norms: F32 around 1
            orig = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            orig = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        if kind == "F32":
            stored, raw_dtype, expected = orig, None, orig
        elif kind == "F16":
            stored, raw_dtype = orig.astype(np.float16), None
            expected = stored.astype(np.float32)
        elif kind == "BF16":
            stored, raw_dtype = gguf.quants.quantize(orig, QT.BF16), QT.BF16
            expected = torch.from_numpy(orig).to(torch.bfloat16).float().numpy()  # round-to-nearest-even
        elif kind in ("Q4_K", "Q6_K"):
            stored, orig = (random_q4_k if kind == "Q4_K" else random_q6_k)(rng, *shape)
            raw_dtype = QT[kind]
            expected = REF_DECODERS[raw_dtype](stored)
        else:
            raw_dtype = QT[kind]
            stored = gguf.quants.quantize(orig, raw_dtype)
            expected = REF_DECODERS[raw_dtype](stored)
        if ".attn_q." in name or ".attn_k." in name:
            stored = permute_llama_cpp(stored, cfg["n_heads"] if ".attn_q." in name else cfg["n_kv_heads"])
        tensors[name] = (np.ascontiguousarray(stored), raw_dtype)
        truth[_hf_name(name)] = dict(type=kind, original=orig, expected=expected, stored=stored, gguf=name)
    write_gguf(path, tensors, **cfg, **write_kw)
    return truth


def full_types(kind="F32", tied=False):
    t = {n: kind for n in MIXED_TYPES}
    t["output_norm.weight"] = "F32"
    if tied:
        del t["output.weight"]
    return t


NORMS = {f"blk.{i}.{k}.weight": "F32" for i in range(2) for k in ("attn_norm", "ffn_norm")}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    truth = build_tiny_gguf(path, {**MIXED_TYPES, **NORMS}, MIXED)
    return path, truth


@pytest.fixture(scope="module")
def mixed_loaded(mixed_gguf):
    path, _ = mixed_gguf
    return read_gguf(path)


# --------------------------------------------------------------------------- 1. dequantization

# Max |error| of each quantizer relative to the block's max |x| (one quantization step, with slack
# for the fp16 scale): Q8_0 step amax/127, Q4_0 step amax/8 (and the clipped -8 end), Q4_1 step
# (max-min)/15 <= 2*amax/15.
QUANT_ERROR = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 2 / 15}


def test_mixed_gguf_has_every_required_type(mixed_gguf):
    from gguf.constants import GGMLQuantizationType
    path, truth = mixed_gguf
    stored = {t.name: GGMLQuantizationType(t.kind).name for t in scan_gguf(path)[1]}
    assert set(stored.values()) >= set(REQUIRED_TYPES)
    for hf, info in truth.items():
        assert stored[info["gguf"]] == info["type"], hf


@pytest.mark.parametrize("kind", REQUIRED_TYPES)
def test_gguf_dequantization(kind, mixed_gguf, mixed_loaded):
    _, truth = mixed_gguf
    _, tensors = mixed_loaded
    checked = [hf for hf, info in truth.items() if info["type"] == kind]
    assert checked, f"no {kind} tensor in the test file"
    for hf in checked:
        info = truth[hf]
        got = tensors[hf]
        assert got.dtype == torch.float32 and tuple(got.shape) == info["original"].shape, hf
        got = got.numpy()
        assert np.isfinite(got).all(), hf
        if kind in ("F32", "F16", "BF16"):  # exact: f32 as stored, f16/bf16 widened exactly
            np.testing.assert_array_equal(got, info["expected"], err_msg=hf)
            if kind != "F32":  # and the rounding was to the nearest representable value
                step = np.abs(info["original"]) * (2 ** -8 if kind == "BF16" else 2 ** -11)
                assert (np.abs(got - info["original"]) <= step + 1e-7).all(), hf
        else:
            # equal to the independent reference decoder (up to float32 evaluation order)
            np.testing.assert_allclose(got, info["expected"], rtol=1e-6, atol=1e-7, err_msg=hf)
            orig = info["original"]
            if kind in QUANT_ERROR:  # and within the quantization error of the original floats
                amax = np.abs(orig.reshape(-1, 32)).max(axis=1, keepdims=True)
                err = np.abs(got.reshape(-1, 32) - orig.reshape(-1, 32))
                assert (err <= QUANT_ERROR[kind] * amax * 1.01 + 1e-7).all(), hf
                assert err.max() > 0  # really quantized
            else:  # K-quants: the packed fields' exact values
                np.testing.assert_allclose(got, orig, rtol=1e-6, atol=1e-7, err_msg=hf)


def test_gguf_q_k_are_unpermuted(mixed_gguf, mixed_loaded):
    _, truth = mixed_gguf
    _, tensors = mixed_loaded
    qk = [hf for hf in truth if ".q_proj." in hf or ".k_proj." in hf]
    assert {truth[hf]["type"] for hf in qk} == {"Q4_K", "Q6_K", "Q8_0", "F16"}
    for hf in qk:
        got, want = tensors[hf].numpy(), truth[hf]["expected"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=hf)
        n_head = MIXED["n_heads"] if ".q_proj." in hf else MIXED["n_kv_heads"]
        as_stored = permute_llama_cpp(want, n_head)  # the file's row order: must differ
        assert not np.allclose(got, as_stored), hf


def test_gguf_args(mixed_loaded):
    args, tensors = mixed_loaded
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (256, 2, 4, 2, 64)
    assert (args.intermediate_size, args.vocab_size, args.max_position_embeddings) == (512, 262, 256)
    assert args.norm_eps == pytest.approx(1e-5) and args.rope_theta == 10000.0
    assert not args.tie_word_embeddings and not args.attention_bias
    assert len(tensors) == 3 + 9 * 2


def test_mixed_gguf_builds_and_runs(mixed_gguf):
    args, tensors, tok = read_checkpoint(mixed_gguf[0])
    assert tok.encode("the the", add_special_tokens=False) == [ord("t"), 257, 258]  # t|he, Ġthe
    model = build_model(args, tensors, "cpu", torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    model.setup_caches(1, 8)
    with torch.no_grad():
        out = model(ids, torch.arange(4))
    assert out.shape == (1, 4, 262) and torch.isfinite(out).all()


# --------------------------------------------------------------------------- 2. against transformers

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ff=128)


def our_logits(args, tensors, ids):
    model = build_model(args, tensors, "cpu", torch.float32)
    T = ids.shape[1]
    model.setup_caches(1, T)
    with torch.no_grad():
        return model(ids, torch.arange(T))


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(ids).logits


IDS = torch.randint(0, 262, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("variant", ["f32", "f32_tied", "mixed"])
def test_gguf_logits_match_transformers(variant, tmp_path):
    transformers = pytest.importorskip("transformers")
    if variant == "mixed":
        types, cfg = {**MIXED_TYPES, **NORMS}, MIXED
    else:
        types, cfg = {**full_types("F32", tied=variant == "f32_tied"), **NORMS}, SMALL
    path = tmp_path / f"tiny-{variant}.gguf"
    build_tiny_gguf(path, types, cfg, seed=3)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                       dtype=torch.float32).eval()
    args, tensors, _ = read_checkpoint(path)
    assert args.tie_word_embeddings == (variant == "f32_tied") == hf.config.tie_word_embeddings
    ref, got = hf_logits(hf, IDS), our_logits(args, tensors, IDS)
    assert ref.abs().max() > 0.5  # not a degenerate model
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- 3. unsupported type

def test_unsupported_gguf_type_is_named(tmp_path):
    """Q1_0 (ggml's 1-bit type) is a real GGUF tensor type that gguf-py knows the block size of but
    cannot dequantize, so neither can this engine: the error must name the tensor and the type."""
    kind = QT.Q1_0
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), kind)
        pytest.skip(f"this gguf version can dequantize {kind.name}; pick another unsupported type")
    except NotImplementedError:
        pass
    path = tmp_path / "q1_0.gguf"
    rng = np.random.default_rng(0)
    tensors = {name: (np.ones(_shape(name, vocab=262, **SMALL), np.float32), None)
               for name in {**full_types("F32"), **NORMS}}
    rows, cols = _shape("blk.1.ffn_down.weight", vocab=262, **SMALL)
    raw = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    raw[:, :2] = np.full((len(raw), 1), 0.01, "<f2").view(np.uint8)  # a finite fp16 block scale
    tensors["blk.1.ffn_down.weight"] = (raw.reshape(rows, -1), kind)
    write_gguf(path, tensors, **SMALL)
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert stored["blk.1.ffn_down.weight"] == kind
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_down\.weight: GGUF type Q1_0 cannot be dequantized"):
        read_checkpoint(path)


# --------------------------------------------------------------------------- 4. corrupt inputs

@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "tiny-f32.gguf"
    build_tiny_gguf(path, {**full_types("F32"), **NORMS}, SMALL, seed=5)
    return path


@pytest.fixture(scope="module")
def small_dir(small_gguf, tmp_path_factory):
    """The small GGUF as an HF directory (config.json, model.safetensors, tokenizer files)."""
    from checkpoint import write_converted_dir
    out = tmp_path_factory.mktemp("small_dir") / "model"
    args, tensors, tok = read_checkpoint(small_gguf)
    write_converted_dir(out, args, tensors, tok)
    return out


def copy_dir(src: Path, dst: Path, skip=()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copyfile(f, dst / f.name)
    return dst


def test_small_dir_loads(small_dir, small_gguf):  # the base of the corrupt-directory cases is sound
    a1, t1, _ = read_checkpoint(small_dir)
    a2, t2, _ = read_checkpoint(small_gguf)
    assert a1 == a2 and t1.keys() == t2.keys()
    for k in t1:
        torch.testing.assert_close(t1[k], t2[k], rtol=0, atol=0)


def test_nonexistent_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.gguf does not exist"):
        read_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "no-such-dir")


@pytest.mark.parametrize("size", [1_000_000, 100])
def test_truncated_real_gguf(size, default_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as f:
        path.write_bytes(f.read(size))
    with pytest.raises(CheckpointError, match=r"cut\.gguf: (truncated or )?corrupt GGUF file: .*(needs|cannot fit)"):
        read_checkpoint(path)


def test_truncated_tiny_gguf_in_tensor_data(small_gguf, tmp_path):
    """Cut inside the tensor data (metadata intact): must not load short/garbage tensors."""
    data = small_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(path)


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match=r"random\.gguf: not a GGUF file \(magic"):
        read_checkpoint(path)


def test_gguf_missing_block_count(tmp_path):
    path = tmp_path / "no-blocks.gguf"
    build_tiny_gguf(path, {**full_types("F32"), **NORMS}, SMALL, skip=("block_count",))
    with pytest.raises(CheckpointError, match=r"missing required field llama\.block_count"):
        read_checkpoint(path)


def test_gguf_gpt2_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    build_tiny_gguf(path, {**full_types("F32"), **NORMS}, SMALL, arch="gpt2")
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'gpt2'"):
        read_checkpoint(path)


def test_dir_without_config(small_dir, tmp_path):
    d = copy_dir(small_dir, tmp_path / "m", skip=("config.json",))
    with pytest.raises(CheckpointError, match="no config.json"):
        read_checkpoint(d)


@pytest.mark.parametrize("content", [b'{"hidden_size": 64,,', b"\x89PNG\r\n\x1a\n\xff\xfe binary"])
def test_config_not_json(content, small_dir, tmp_path):
    d = copy_dir(small_dir, tmp_path / "m")
    (d / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON"):
        read_checkpoint(d)


def test_config_missing_hidden_size(small_dir, tmp_path):
    d = copy_dir(small_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing required field.*hidden_size"):
        read_checkpoint(d)


def test_config_without_safetensors(small_dir, tmp_path):
    d = copy_dir(small_dir, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        read_checkpoint(d)


@pytest.mark.parametrize("size, message", [(1_000_000, r"truncated or corrupt: tensor model\.embed_tokens\.weight .* ends past"),
                                           (100, r"truncated or corrupt safetensors file")])
def test_truncated_real_safetensors(size, message, default_dir, tmp_path):
    d = copy_dir(default_dir, tmp_path / "m", skip=("model.safetensors",))
    with open(default_dir / "model.safetensors", "rb") as f:
        (d / "model.safetensors").write_bytes(f.read(size))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: " + message):
        read_checkpoint(d)


def _write_shards(d: Path, tensors: dict, n: int) -> list[str]:
    from safetensors.torch import save_file
    names = sorted(tensors)
    files, weight_map = [], {}
    for s in range(n):
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[s::n]}
        save_file(part, str(d / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def test_sharded_index_names_missing_shard(small_dir, tmp_path):
    d = copy_dir(small_dir, tmp_path / "m", skip=("model.safetensors",))
    _, tensors = read_hf_dir(small_dir)
    files = _write_shards(d, tensors, 3)
    args, got = read_hf_dir(d)  # all shards present: loads, same tensors
    assert got.keys() == tensors.keys()
    (d / files[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"weight file {files[1]} listed in the index is missing"):
        read_checkpoint(d)


@pytest.mark.parametrize("content", ['{"weight_map": ', '{"metadata": {}}', '[]', '{"weight_map": []}'])
def test_sharded_index_corrupt(content, small_dir, tmp_path):
    d = copy_dir(small_dir, tmp_path / "m", skip=("model.safetensors",))
    _, tensors = read_hf_dir(small_dir)
    _write_shards(d, tensors, 2)
    (d / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a valid safetensors index"):
        read_checkpoint(d)


def test_safetensors_missing_tensor(small_dir, tmp_path):
    from safetensors.torch import save_file
    d = copy_dir(small_dir, tmp_path / "m", skip=("model.safetensors",))
    _, tensors = read_hf_dir(small_dir)
    gone = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v.contiguous() for k, v in tensors.items() if k != gone}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"m: checkpoint is missing tensor {re.escape(gone)}"):
        read_checkpoint(d)      # refused before any tensor is read


# --------------------------------------------------------------------------- 5. sharded + mmap

def _mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges where `path` is memory-mapped in this process (Linux /proc/self/maps)."""
    target, ranges = str(Path(path).resolve()), []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _in_mapping(t: torch.Tensor, ranges) -> bool:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return any(lo <= start and end <= hi for lo, hi in ranges)


@pytest.fixture(scope="module")
def sharded_hf(small_gguf, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so a wrong norm mapping cannot pass
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("sharded") / "model"
    hf.save_pretrained(d, max_shard_size="200KB")
    Tokenizer.from_gguf(small_gguf).write_hf_files(d)
    return hf, d


def test_sharded_safetensors_match_transformers(sharded_hf):
    hf, d = sharded_hf
    shards = sorted(d.glob("*.safetensors"))
    assert (d / "model.safetensors.index.json").is_file() and len(shards) >= 2
    args, tensors, tok = read_checkpoint(d)
    assert set(tensors) >= {n for n, _ in hf.named_parameters()}
    assert tok.vocab_size == 262
    torch.testing.assert_close(our_logits(args, tensors, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_read_safetensors_reads_each_tensor(sharded_hf):
    """Every tensor equal to safetensors' own reader, in memory of its own (no mapping of the file stays)."""
    from safetensors.torch import load_file
    _, d = sharded_hf
    for shard in sorted(d.glob("*.safetensors")):
        mapped = _mappings(shard)                     # the fixture's own readers may hold mappings
        got = read_safetensors(shard)
        assert _mappings(shard) == mapped, f"{shard} is memory-mapped by read_safetensors"
        want = load_file(str(shard))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


LOAD_MEMORY = """
import sys, engine
from kernels.cpu import cpu_kernels_available
cpu_kernels_available()
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
before = status("VmRSS")
model, _ = engine.load_model(sys.argv[1], "cpu")
tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
print(status("VmHWM") - before, sum(tensors.values()), "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("which", ["dir", "gguf"])
def test_loading_holds_the_weights_once(which, default_dir, default_gguf):
    """Loading the real default model (fp32 directory, Q4_1 GGUF run as int4) raises the process's peak
    RSS by its weights plus the tokenizer (~50 MB) and small temporaries: no mapped file, reader or copy
    stays behind (the fp32 directory once grew by 513 + 265 MiB, the GGUF by 92 + 317 MiB), and an
    eager load never imports torch._dynamo (~150 MB)."""
    path = default_dir if which == "dir" else default_gguf
    out = subprocess.run([sys.executable, "-c", LOAD_MEMORY, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    grown, weights, dynamo = out.stdout.split()[-3:]
    grown, weights = int(grown), int(weights)
    assert dynamo == "False"
    assert grown < weights + 150 * 2**20, f"peak RSS grew {grown / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"


# --------------------------------------------------------------------------- 6. convert script

@pytest.fixture(scope="module")
def convert_main():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import convert_checkpoint
    finally:
        sys.path.remove(str(SCRIPTS))
    return convert_checkpoint.main


def test_convert_gguf(convert_main, mixed_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    src, out = mixed_gguf[0], tmp_path / "converted"
    assert convert_main([str(src), str(out)]) == 0
    args_g, tensors_g, tok_g = read_checkpoint(src)
    args_c, tensors_c, tok_c = read_checkpoint(out)
    assert args_c == args_g and tensors_c.keys() == tensors_g.keys()
    for k in tensors_g:  # float32 GGUF dequantization stored as is
        torch.testing.assert_close(tensors_c[k], tensors_g[k], rtol=0, atol=0)
    assert tok_c.encode("the the hello", add_special_tokens=False) == tok_g.encode("the the hello", add_special_tokens=False)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ref = hf_logits(hf, IDS)
    torch.testing.assert_close(our_logits(args_c, tensors_c, IDS), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(our_logits(args_g, tensors_g, IDS), ref, atol=1e-4, rtol=1e-4)


def test_convert_missing_source(convert_main, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert_main([str(tmp_path / "missing.gguf"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "missing.gguf" in err
    assert not out.exists()
