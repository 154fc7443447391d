"""Attention kernels for the sparse-read policies (HShare, Double Sparsity, Quest): a Triton kernel and
a torch "twin" (the CPU path and the reference) per operation, dispatched by device.

    sparse_decode_attention   exact attention of one decode query over an index list of cached tokens
    approx_scores             approximate scores q_label . label (float or 4-bit packed labels)
    mask_sink_recent          force sinks / recent tokens (+inf) and hide positions >= length (-inf)
    select_critical           top-k of masked scores -> index list for sparse_decode_attention
    kivi_attention (kernels.kivi_attention)  the same over SlotStore's packed slots + residual ring, one op
    quantize_labels_4bit ...  4-bit label packing helpers

Every dispatcher takes `backend="auto" | "triton" | "torch"`: "auto" runs Triton when the tensors live
on CUDA (and Triton imports), the torch twin otherwise.  "triton" on CPU tensors needs the Triton
interpreter: TRITON_INTERPRET=1 must be in the environment before the first Triton call (the kernels
are built lazily, on first use, so importing this package never imports Triton).
"""
import os

import torch

BACKENDS = ("auto", "triton", "torch", "cpp")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """"triton" or "torch" for a call on `tensors` (shape/device checks only, never a host sync).
    "cpp" (the C++ CPU kernels, kernels/cpu.py) resolves to "torch" here: the dispatchers that have a
    C++ kernel check for it first (`cpu.use_cpu_kernel`), the others run their twin."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if backend in ("torch", "cpp"):
        return "torch"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("backend='triton' but triton is not installed")
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                           "before the first Triton call")
    return "triton"


from .sparse_attention import (sparse_decode_attention, sparse_decode_attention_torch,  # noqa: E402
                               sparse_decode_attention_triton)
from .label_scores import (approx_scores, approx_scores_torch, approx_scores_triton,  # noqa: E402
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
