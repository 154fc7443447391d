"""Attention kernels for the sparse-read policies (HShare, Double Sparsity, Quest): a Triton kernel and
a torch "twin" (the CPU path and the reference) per operation, dispatched by device.

    sparse_decode_attention   exact attention of one decode query over an index list of cached tokens
    approx_scores             approximate scores q_label . label (float or 4-bit packed labels)
    mask_sink_recent          force sinks / recent tokens (+inf) and hide positions >= length (-inf)
    select_critical           top-k of masked scores -> index list for sparse_decode_attention
    kivi_attention (kernels.kivi_attention)  the same over SlotStore's packed slots + residual ring, one op
    quantize_labels_4bit ...  4-bit label packing helpers

Every dispatcher takes `backend="auto" | "triton" | "torch"` (kernels/backend.py says what each runs).
KIVI's KV codec (group quantization and bit packing) is kernels/kivi_codec.py.
"""
from .backend import BACKENDS, resolve_backend, triton_available
from .sparse_attention import (sparse_decode_attention, sparse_decode_attention_torch,
                               sparse_decode_attention_triton)
from .label_scores import (approx_scores, approx_scores_torch, approx_scores_triton,
                           dequantize_labels_4bit, mask_sink_recent, mask_sink_recent_torch,
                           mask_sink_recent_triton, pack_4bit, quantize_labels_4bit, select_critical,
                           unpack_4bit)

__all__ = [
    "BACKENDS", "resolve_backend", "triton_available",
    "sparse_decode_attention", "sparse_decode_attention_torch", "sparse_decode_attention_triton",
    "approx_scores", "approx_scores_torch", "approx_scores_triton",
    "mask_sink_recent", "mask_sink_recent_torch", "mask_sink_recent_triton", "select_critical",
    "pack_4bit", "unpack_4bit", "quantize_labels_4bit", "dequantize_labels_4bit",
]
