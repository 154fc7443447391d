"""Sparse decode attention: one query token per sequence attends to an index list of cached tokens.

    sparse_decode_attention(q, k_cache, v_cache, idx, valid=None, scale=None, *, backend="auto",
                            n_splits=None, block_n=None, workspace=None)

      q        [B, H_q, D]  (or [B, H_q, 1, D]; the output has q's rank)
      k_cache  [B, H_kv, S, D], v_cache [B, H_kv, S, D]   any strides; only the indexed rows are read
      idx      [B, H_idx, N] long or int32, slots into S; H_idx is
                 H_kv: one index list per KV head, shared by its G = H_q / H_kv query heads (the
                       gathered K/V rows are read once per group: GQA-shared gather), or
                 H_q:  one index list per query head (query head h reads KV head h // G, the
                       HuggingFace `repeat_kv` order); used when heads borrow other heads' lists
      valid    [B, H_idx, N] bool or None: False entries are ignored (their idx may hold anything,
               e.g. -1); a row without any valid entry returns 0
      scale    softmax scale, default 1/sqrt(D)
      -> out   [B, H_q, D] in q's dtype; scores, softmax and the weighted sum in fp32 (the Triton
               kernel, like FlashAttention, feeds the probabilities to the P.V dot in the input
               dtype when that is fp16/bf16).  q, k, v share one dtype: fp32, fp16 or bf16.
      D        any head_dim (the kernel pads to a power of two >= 16 and masks); 64 and 128 tested.

Indices must be unique within a row (what top-k returns).  A duplicated index is not an error: both
backends then count that token once per occurrence (it gets that many times its softmax weight),
which is *not* attention over the index set.  Valid indices must lie in [0, S); nothing is checked on
the device (no host syncs).

Backends: the torch twin gathers the N rows with one `index_select` over a flat row view of the
cache (much faster on CPU than `torch.gather` with an expanded index) and does two small matmuls;
the Triton kernel runs a grid (B, H_idx, n_splits): each program loads its slice of the index list,
gathers K/V rows block by block and keeps an fp32 online softmax (max, sum, acc) for the query heads
that share the list; with n_splits > 1 a second kernel combines the splits by log-sum-exp.
GQA-shared lists put the G query heads in the rows of a tl.dot (padded to 16); per-query-head lists
use a one-row elementwise path.  On fp32 CPU tensors "auto" runs the C++ kernel of kernels/cpu.py
(each selected row read once, in place), the twin's result within float rounding.
"""
import math
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from .backend import resolve_backend
from .cpu import sparse_attention_supported, sparse_decode_attention_cpu, use_cpu_kernel




def _shapes(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor, valid: Optional[Tensor]):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_q, D] or [B, H_q, 1, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be [B={B}, H_kv, S, D={D}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"H_q={Hq} is not a multiple of H_kv={Hkv}")
    if idx.dim() != 3 or idx.shape[0] != B or idx.shape[1] not in (Hkv, Hq):
        raise ValueError(f"idx must be [B={B}, H_kv={Hkv} or H_q={Hq}, N], got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"idx must be int64 or int32, got {idx.dtype}")
    if valid is not None and (valid.shape != idx.shape or valid.dtype != torch.bool):
        raise ValueError(f"valid must be a bool tensor shaped like idx {tuple(idx.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"q/k/v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    return B, Hq, Hkv, S, D, idx.shape[1], idx.shape[2]


def _rows(cache: Tensor) -> tuple[Tensor, int, int]:
    """A zero-copy [n_rows, D] view of `cache` [B, H, S, D] whose row (b, h, s) is
    b * rb + h * rh + s; falls back to a contiguous copy when rows are not evenly strided."""
    B, H, S, D = cache.shape
    sb, sh, ss, sd = cache.stride()
    if not (sd == 1 and ss == D and sh % D == 0 and sb % D == 0):
        cache = cache.contiguous()
        sb, sh = H * S * D, S * D
    rb, rh = sb // D, sh // D
    n_rows = (B - 1) * rb + (H - 1) * rh + S
    return cache.as_strided((n_rows, D), (D, 1)), rb, rh


def _gather(cache: Tensor, idx: Tensor, workspace: Optional[dict] = None, name: str = "k") -> Tensor:
    """cache [B, H, S, D], idx [B, H, M] -> rows [B, H, M, D] (one index_select).  With a workspace
    dict the rows are written into a buffer kept there (reused by the next call of the same shape)."""
    B, H, M = idx.shape
    D = cache.shape[-1]
    rows, rb, rh = _rows(cache)
    base = (torch.arange(B, device=idx.device) * rb)[:, None, None] \
        + (torch.arange(H, device=idx.device) * rh)[None, :, None]
    flat = (idx + base).reshape(-1)
    if workspace is None:
        return rows.index_select(0, flat).view(B, H, M, D)
    key = (name, B * H * M, D, cache.dtype, cache.device)
    buf = workspace.get(key)
    if buf is None:
        buf = workspace[key] = torch.empty((B * H * M, D), dtype=cache.dtype, device=cache.device)
    return torch.index_select(rows, 0, flat, out=buf).view(B, H, M, D)


def sparse_decode_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor,
                                  valid: Optional[Tensor] = None, scale: Optional[float] = None,
                                  workspace: Optional[dict] = None) -> Tensor:
    """The torch twin (CPU path and reference); see the module docstring for the contract.

    workspace: an optional dict owned by the caller (e.g. the policy object) in which the gathered
    K/V rows are kept between calls.  On CPU a fresh multi-MB gather output per call is served by
    mmap and page-faulted in on every step, which can cost more than the gather itself."""
    squeeze = q.dim() == 4
    if squeeze:
        q = q.squeeze(2)
    B, Hq, Hkv, S, D, Hidx, N = _shapes(q, k_cache, v_cache, idx, valid)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if valid is not None:
        idx = torch.where(valid, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
    if Hidx == Hkv:   # shared list: [B, Hkv, N] -> rows [B, Hkv, N, D]; q as [B, Hkv, G, D]
        qg = q.reshape(B, Hkv, G, D)
        kk, vv = _gather(k_cache, idx, workspace, "k"), _gather(v_cache, idx, workspace, "v")
        vmask = None if valid is None else valid[:, :, None, :]               # [B, Hkv, 1, N]
    else:             # per query head: [B, Hkv, G*N] -> rows [B, Hkv, G, N, D]; q as [B, Hkv, G, 1, D]
        qg = q.reshape(B, Hkv, G, 1, D)
        flat = idx.reshape(B, Hkv, G * N)
        kk = _gather(k_cache, flat, workspace, "k").view(B, Hkv, G, N, D)
        vv = _gather(v_cache, flat, workspace, "v").view(B, Hkv, G, N, D)
        vmask = None if valid is None else valid.reshape(B, Hkv, G, 1, N)
    if q.dtype != torch.float32:   # fp32 math; only the N gathered rows are converted
        qg, kk, vv = qg.float(), kk.float(), vv.float()
    s = torch.matmul(qg, kk.transpose(-1, -2)) * scale
    if vmask is not None:
        s = s.masked_fill(~vmask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # all-invalid row: p = 0, out = 0
    p = torch.exp(s - m)
    out = torch.matmul(p, vv) / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    out = out.reshape(B, Hq, D).to(q.dtype)
    return out.unsqueeze(2) if squeeze else out


# ----------------------------------------------------------------------------------------- Triton
@lru_cache(maxsize=None)
def _kernels():
    """(sparse_attn_partial, sparse_attn_combine), importing Triton on first use."""
    from kernels import sparse_attention_triton as k
    return k.sparse_attn_partial, k.sparse_attn_combine


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _auto_splits(device: torch.device, programs: int, n_blocks: int) -> int:
    """Enough programs to fill the GPU (about 2 per SM), never more splits than index blocks."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 1
    return max(1, min(n_blocks, -(-2 * sms // programs)))


def sparse_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor,
                                   valid: Optional[Tensor] = None, scale: Optional[float] = None,
                                   n_splits: Optional[int] = None, block_n: Optional[int] = None) -> Tensor:
    """The Triton kernel.  n_splits: how many programs share one index list (default: enough to fill
    the GPU); block_n: index entries per inner step (default 64 for D <= 64, else 32)."""
    squeeze = q.dim() == 4
    if squeeze:
        q = q.squeeze(2)
    B, Hq, Hkv, S, D, Hidx, N = _shapes(q, k_cache, v_cache, idx, valid)
    G = Hq // Hkv
    per_query = Hidx == Hq and G > 1
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    BLOCK_D = max(16, _next_pow2(D))
    BLOCK_N = block_n or (64 if BLOCK_D <= 64 else 32)
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {BLOCK_N}")
    BLOCK_G = 1 if per_query else max(16, _next_pow2(G))
    n_blocks = max(1, -(-N // BLOCK_N))
    if n_splits is None:
        n_splits = _auto_splits(q.device, B * Hidx, n_blocks)
    n_splits = max(1, min(int(n_splits), n_blocks))
    n_per_split = -(-n_blocks // n_splits) * BLOCK_N
    n_splits = max(1, -(-N // n_per_split))            # no empty trailing split
    single = n_splits == 1
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if single:
        m_part = l_part = acc_part = out               # unused
    else:
        m_part = torch.empty((B, Hq, n_splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((B, Hq, n_splits, BLOCK_D), dtype=torch.float32, device=q.device)
    vmask = idx if valid is None else valid.view(torch.uint8)
    partial, combine = _kernels()
    partial[(B, Hidx, n_splits)](
        q, k_cache, v_cache, idx, vmask, out, m_part, l_part, acc_part,
        scale, N, G, n_per_split, n_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *idx.stride(), *vmask.stride(), *out.stride(),
        D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, BLOCK_G=BLOCK_G, PER_QUERY=per_query,
        HAS_VALID=valid is not None, SINGLE=single,
        DOT_F32=q.dtype == torch.bfloat16 and not q.is_cuda)   # CPU tensors = the interpreter
    if not single:
        combine[(B, Hq)](out, m_part, l_part, acc_part, n_splits, *out.stride(),
                         D=D, BLOCK_D=BLOCK_D, BLOCK_SPLIT=_next_pow2(n_splits))
    return out.unsqueeze(2) if squeeze else out


def sparse_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor,
                            valid: Optional[Tensor] = None, scale: Optional[float] = None, *,
                            backend: str = "auto", n_splits: Optional[int] = None,
                            block_n: Optional[int] = None, workspace: Optional[dict] = None) -> Tensor:
    """Dispatcher: Triton on CUDA tensors, the C++ kernel on fp32 CPU tensors (kernels/cpu.py; "auto"
    when it is built, or backend="cpp"), the torch twin otherwise (see the module docstring).
    n_splits/block_n tune the Triton kernel; workspace (a caller-owned dict) is used by the twin."""
    if resolve_backend(backend, q, k_cache, v_cache, idx) == "triton":
        return sparse_decode_attention_triton(q, k_cache, v_cache, idx, valid, scale, n_splits, block_n)
    if use_cpu_kernel(backend, sparse_attention_supported(q, k_cache, v_cache)):
        return sparse_decode_attention_cpu(q, k_cache, v_cache, idx, valid, scale)
    return sparse_decode_attention_torch(q, k_cache, v_cache, idx, valid, scale, workspace)
