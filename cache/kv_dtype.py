"""Unquantized KV storage in a chosen dtype (`--kv-dtype`), and the one entry point for every storage flag.

    kv_storage(policy, bits, group, residual, kv_dtype=None)
        bits 16: the policy as it is (K/V in the compute dtype), or `full` storing K/V in kv_dtype
        bits 32: `full` storing K/V in float32 (the default storage on CPU, named explicitly)
        bits 4 / 2: KIVI-packed (cache/quantized.py: with_kv_bits); kv_dtype must be None
    StoredDenseCache(kv_dtype)   `full` with K/V buffers in kv_dtype while the model computes in its own

A 16-bit cache under an fp32 model is the fair baseline of 4/2-bit storage: half the KV bytes of the
default fp32 cache.  Decode reads it with the C++ op `kvc::dense_attention` (bf16 rows widened in
registers, kernels/cpu_kernels.cpp) when every slot is visible (no left padding, no sliding window;
decided once per request after prefill), else through an fp32 copy of the live slots; prefill
attends in the compute dtype.  Only `full` has it: the other policies keep their K/V in the compute
dtype (their storage hooks are cache/base.py's) or packed.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cache.quantized import with_kv_bits
from kernels.cpu import cpu_kernels_available, dense_attention_cpu, use_cpu_kernel
from cache.full import FullCache
from model import grouped_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StoredDenseCache(FullCache):
    """`full` with its K/V stored in `kv_dtype`: an ordinary subclass of cache.full.FullCache (`kv_storage`
    returns one in place of the plain `full`)."""

    name = "full"
    storage_kind = "dense_dtype"
    fused_dense_decode = False          # its own decode (below)

    def __init__(self, kv_dtype: torch.dtype):
        self.kv_dtype = kv_dtype
        self.compute_dtype, self.dense_ok = None, False     # (setup)

    def setup(self, args, max_batch_size: int, max_seq_length: int, dtype: torch.dtype, device) -> None:
        self.compute_dtype = dtype
        super().setup(args, max_batch_size, max_seq_length, self.kv_dtype, device)
        self.dense_ok = False
        if torch.device(device).type == "cpu":
            cpu_kernels_available()        # build now, on the host: never inside a compiled region

    def end_prefill(self) -> None:
        """Host side, once per request: decode may skip the mask when every slot holds a token."""
        self.dense_ok = not self.sliding_window and bool((self.pos[:, :self.n_filled] >= 0).all())

    def reset(self) -> None:
        super().reset()
        self.dense_ok = False

    def begin_static_step(self) -> int:
        """FullCache's, and the masked read from now on: a static step reads a bucket whose last slots are empty."""
        self.dense_ok = False
        return super().begin_static_step()

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.store(layer, k, v)
        kc, vc, n = self.k[layer], self.v[layer], self.n_read
        if self.kv_dtype == q.dtype:
            return grouped_attention(q, kc[:, :, :n], vc[:, :, :n], self.mask)
        if q.shape[2] == 1 and self.dense_ok and use_cpu_kernel("auto", dense_supported(q, kc)):
            return dense_attention_cpu(q, kc, vc, n)
        return grouped_attention(q, kc[:, :, :n].to(q.dtype), vc[:, :, :n].to(q.dtype), self.mask)

    decode = prefill

    def release(self, row: int) -> None:
        super().release(row)
        self.dense_ok = False       # the released row's slots are empty

    def storage(self, layer: int):
        raise NotImplementedError(f"the sparse readers read `full` in the compute dtype, not --kv-dtype "
                                  f"{str(self.kv_dtype).removeprefix('torch.')}")

    def describe(self) -> dict:
        return {**super().describe(), "kv_dtype": str(self.kv_dtype).removeprefix("torch.")}


def dense_supported(q: Tensor, k: Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] in (64, 128) and k.stride(3) == 1)


def kv_storage(policy, bits: int, group: int, residual: int, kv_dtype: Optional[str] = None,
               compute_dtype: Optional[torch.dtype] = None):
    """The policy (not yet set up) with the storage the flags ask for (module docstring; a storage dtype
    equal to compute_dtype, when given, is the policy as it is); ValueError with a one-line message
    otherwise."""
    if bits in (32, 16):
        dtype = torch.float32 if bits == 32 else DTYPES[kv_dtype] if kv_dtype else None
        if bits == 32 and kv_dtype not in (None, "float32"):
            raise ValueError(f"--kv-bits 32 stores float32, not --kv-dtype {kv_dtype}")
        if dtype is None or dtype == compute_dtype:
            return policy
        if policy.storage_kind != "dense":
            raise ValueError(f"--kv-bits {bits} / --kv-dtype: only `full` stores K/V in another dtype than the "
                             f"compute dtype, not {policy.name!r}")
        return StoredDenseCache(dtype)
    if kv_dtype is not None:
        raise ValueError(f"--kv-dtype applies to unquantized storage (--kv-bits 32 or 16), not --kv-bits {bits}")
    return with_kv_bits(policy, bits, group, residual)
