"""Our quantized directories (written by `python quantize.py`): the "quantization_config" scheme and
the X.qweight / X.scales [/ X.mins] tensors of each quantized linear weight <-> one QWeight."""
from __future__ import annotations

import torch

from checkpoint.check import CheckpointError
from kernels.qlinear import QWeight, check_qweight
from model import ModelArgs

QUANT_METHOD = "kvpolicy-weight-only"


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
