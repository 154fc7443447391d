"""Decode attention over KIVI storage with its full-precision residual, in one op (cache/quantized.py's
SlotStore holds the buffers; their layout is kernels/kivi_codec.py's, token-contiguous).

    kivi_attention(q, buf, pos, visible, now, n, scale=None, idx=None, valid=None, *, backend="auto")
      q        [B, H_q, D] or [B, H_q, 1, D]; query head h reads KV head h // (H_q // H)
      buf      KIVIBuffers: packed words, scales, minimums and the two rings [B, H, R, D]
      pos      [B, 1 or H, >= n] long: the position each slot holds (-1 = empty)
      visible  [B, 1 or H, >= n] bool (True = attend), or None: every slot < n (dense reads only)
      now      [B] long: the current query's position
      n        host int: slots [0, n) are read (dense), or
      idx      [B, H or H_q, N] long: the slots to read (the sparse readers' selection), valid [B, ., N]
               bool or None; invalid entries may hold anything
      -> out [B, H_q, D] (or [B, H_q, 1, D]) in q's dtype: softmax attention, scores and sums in fp32

The residual (KIVI's rule): a slot holding position p is read from ring row p % R
    key:   while p is in the R-block still filling, p >= (now + 1) - (now + 1) mod R: keys are
           quantized block-wise, R at a time, so the n mod R newest tokens stay exact;
    value: while p > now - R: a FIFO of the R newest tokens;
and from the packed words otherwise (`ring_flags`).

Backends ("auto": the C++ op on CPU fp32 tensors it supports, Triton on CUDA, the torch twin
otherwise; "cpp", "triton", "torch" to choose; "triton" on CPU tensors needs TRITON_INTERPRET=1):
- C++ (kernels/kivi_kernels.cpp, `kvc::kivi_attention`): per (batch row, KV head), the key scale
  folded into the query per group (q * s_k) and the key minimum into one dot product per group;
  codes unpacked in registers 16 slots at a time; value scale/minimum applied to the softmax weights;
  ring slots found from `pos` in the same pass.  Sparse reads dequantize each selected row in registers.
  Dense reads of 2/4-bit storage run in integer arithmetic where the CPU has AVX-512 VNNI (int8
  queries x codes, uint8 weights x codes; the scheme and its twin: kernels/kivi_int.py); KVC_KIVI_ARITH
  chooses otherwise (kernels/cpu.py `kivi_arith_default`: auto, int, fp32, avx2, vnni).
- Triton (kernels/kivi_triton.py): the same folding, one key group per block; dense reads of 2/4-bit
  storage in integer arithmetic (kernels/kivi_int_triton.py; KVC_KIVI_ARITH auto or int; fp32 keeps the
  fp32-arithmetic kernel, 5.7x slower on an H100).
- torch twin (here, the reference): packed scores and weighted values block by block
  (kernels.quantized_attention), ring rows substituted by `where`; sparse reads gather the N rows
  (`kivi_gather`) and run the sparse twin over them.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .backend import resolve_backend
from .kivi_codec import QuantizedTensor, dequantize_values, unpack
from .quantized_attention import _softmax_stats, quantized_scores, quantized_weighted_values


class KIVIBuffers(NamedTuple):
    """One layer's KIVI storage (shapes: cache/quantized.py's SlotStore)."""
    k_packed: Tensor      # [B, H, C, W] int32 (token-contiguous view)
    k_scale: Tensor       # [B, H, C // G, D]
    k_min: Tensor
    v_packed: Tensor      # [B, H, C, W] int32
    v_scale: Tensor       # [B, H, C, D // G] (token-contiguous view)
    v_min: Tensor
    k_ring: Tensor        # [B, H, R, D]
    v_ring: Tensor
    bits: int
    group: int

    @property
    def residual(self) -> int:
        return self.k_ring.shape[2]


def ring_flags(pos: Tensor, now: Tensor, residual: int) -> tuple[Tensor, Tensor]:
    """(key_exact, value_exact) bool like pos [B, H or 1, m] for positions at query position now [B]:
    value_exact = held and among the newest R; key_exact = value_exact and in the R-block still
    filling (p >= (now + 1) - (now + 1) mod R).  Both are ring rows p % R."""
    nxt = now[:, None, None] + 1
    value = (pos >= 0) & (pos > nxt - 1 - residual)
    return value & (pos >= nxt - nxt.remainder(residual)), value


def whole_groups(t: Tensor, n: int, group: int, fill) -> tuple[Tensor, int]:
    """t [..., >= n] -> ([..., ne], ne): its first n columns then `fill`, ne = n rounded up to whole
    groups.  Reads go over whole groups, and no tensor is sized ne - n: a size that can be 0 or 1
    would be specialized by torch.compile (a graph per n % G)."""
    ne = -(-n // group) * group
    idx = torch.arange(ne, device=t.device)
    got = t.gather(-1, idx.clamp(max=n - 1).expand(*t.shape[:-1], ne))
    return torch.where(idx < n, got, fill), ne


def ring_rows(ring: Tensor, pos: Tensor) -> Tensor:
    """Ring rows pos % R for pos [B, H or 1, m] -> [B, H, m, D] fp32."""
    B, H, R, D = ring.shape
    rows = pos.remainder(R).expand(B, H, pos.shape[2])
    return ring.gather(2, rows[..., None].expand(-1, -1, -1, D)).float()


def kivi_scores(qg: Tensor, buf: KIVIBuffers, p: Tensor, now: Tensor, ne: int) -> Tensor:
    """qg . k_t for the ne slots (whole groups) holding positions p [B, H or 1, ne]: qg [B, H, Gq, D]
    fp32 (any scale folded in) -> [B, H, Gq, ne]; residual keys from the ring."""
    B, H, Gq, _ = qg.shape
    s = quantized_scores(qg, buf.k_packed, buf.k_scale, buf.k_min, ne, buf.bits, buf.group)
    ring = qg @ buf.k_ring.float().transpose(-1, -2)                                # [B, H, Gq, R]
    rows = p.remainder(buf.residual)[:, :, None, :].expand(B, H, Gq, ne)
    return torch.where(ring_flags(p, now, buf.residual)[0][:, :, None], ring.gather(-1, rows), s)


def kivi_values(prob: Tensor, buf: KIVIBuffers, p: Tensor, now: Tensor, ne: int) -> Tensor:
    """sum_t prob_t v_t over the ne slots holding positions p [B, H or 1, ne]: prob [B, H, Gq, ne] fp32
    -> [B, H, Gq, D] fp32; values of the newest R from the ring."""
    B, H, Gq, _ = prob.shape
    R = buf.residual
    exact = ring_flags(p, now, R)[1][:, :, None].expand(B, H, Gq, ne)
    out = quantized_weighted_values(prob.masked_fill(exact, 0.0), buf.v_packed, buf.v_scale, buf.v_min, ne,
                                    buf.bits, buf.group)
    rows = torch.where(exact, p.remainder(R)[:, :, None], R)
    p_ring = prob.new_zeros(B, H, Gq, R + 1).scatter_add_(-1, rows, prob.masked_fill(~exact, 0.0))
    return out + p_ring[..., :R] @ buf.v_ring.float()


def kivi_gather(buf: KIVIBuffers, idx: Tensor, pos: Tensor, now: Tensor) -> tuple[Tensor, Tensor]:
    """(k, v) [B, H, N, D] fp32 of slots idx [B, H, N] (< C): only those rows are dequantized (each key
    with its group's scale/minimum), residual ones come from the ring; pos [B, H or 1, S]."""
    G, W = buf.group, buf.k_packed.shape[-1]
    D = buf.k_ring.shape[-1]
    at_w = idx[..., None].expand(-1, -1, -1, W)
    at_g = (idx // G)[..., None].expand(-1, -1, -1, D)
    k = (unpack(buf.k_packed.gather(2, at_w), buf.bits, -1).float() * buf.k_scale.gather(2, at_g).float()
         + buf.k_min.gather(2, at_g).float())
    at_c = idx[..., None].expand(-1, -1, -1, D // G)
    v = dequantize_values(QuantizedTensor(buf.v_packed.gather(2, at_w), buf.v_scale.gather(2, at_c),
                                          buf.v_min.gather(2, at_c), buf.bits, G), torch.float32)
    S = pos.shape[2]
    pm = pos.expand(idx.shape[0], idx.shape[1], S).gather(2, idx.clamp(max=S - 1))
    pm = torch.where(idx < S, pm, -1)
    key_exact, value_exact = ring_flags(pm, now, buf.residual)
    return (torch.where(key_exact[..., None], ring_rows(buf.k_ring, pm), k),
            torch.where(value_exact[..., None], ring_rows(buf.v_ring, pm), v))


def _dense_torch(qg: Tensor, buf: KIVIBuffers, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int) -> Tensor:
    """The twin over slots [0, n): qg [B, H, Gq, D] scaled -> [B, H, Gq, D] fp32."""
    p, ne = whole_groups(pos, n, buf.group, -1)
    vis = whole_groups(torch.ones_like(pos[..., :n], dtype=torch.bool) if visible is None else visible, n,
                       buf.group, False)[0]
    s = kivi_scores(qg, buf, p, now, ne).masked_fill(~vis[:, :, None], float("-inf"))
    prob, _ = _softmax_stats(s)
    return kivi_values(prob, buf, p, now, ne)


def kivi_attention_torch(q: Tensor, buf: KIVIBuffers, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int,
                         scale: Optional[float] = None, idx: Optional[Tensor] = None,
                         valid: Optional[Tensor] = None) -> Tensor:
    """The torch twin (the reference; see the module docstring)."""
    from .sparse_attention import sparse_decode_attention_torch
    q3 = q[:, :, 0] if q.dim() == 4 else q
    B, Hq, D = q3.shape
    H = buf.k_packed.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if idx is None:
        qg = q3.float().view(B, H, Hq // H, D) * scale
        out = _dense_torch(qg, buf, pos, visible, now, n).view(B, Hq, D)
    else:
        heads = idx if idx.shape[1] == H else idx.view(B, H, -1)            # per-query-head lists by KV head
        k, v = kivi_gather(buf, heads.clamp(0, pos.shape[2] - 1), pos, now)
        if visible is not None:                                             # invisible entries are not read
            seen = visible.expand(B, H, visible.shape[2]).gather(2, heads.clamp(0, visible.shape[2] - 1))
            valid = seen.view(idx.shape) if valid is None else valid & seen.view(idx.shape)
        ar = torch.arange(heads.shape[2], device=idx.device).expand(heads.shape).reshape(idx.shape)
        out = sparse_decode_attention_torch(q3.float(), k, v, ar, valid, scale)
    out = out.to(q.dtype)
    return out.unsqueeze(2) if q.dim() == 4 else out


def cpp_supported(q: Tensor, buf: KIVIBuffers, dense: bool) -> bool:
    """Whether the C++ op takes this call (fp32 CPU, D 64/128, G % 8 == 0 (dense: % 16), D / G <= 16, words
    token-contiguous or, for sparse reads, slot-major: cache.quantized.SlotStore.reader_buffers)."""
    D, G = q.shape[-1], buf.group
    kp = buf.k_packed
    return (q.device.type == "cpu" and q.dtype == buf.k_scale.dtype == buf.k_ring.dtype == torch.float32
            and D in (64, 128) and G % (16 if dense else 8) == 0 and D % G == 0 and D // G <= 16
            and (kp.stride(2) == 1 or (not dense and kp.is_contiguous())))


def kivi_attention(q: Tensor, buf: KIVIBuffers, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int,
                   scale: Optional[float] = None, idx: Optional[Tensor] = None, valid: Optional[Tensor] = None, *,
                   backend: str = "auto") -> Tensor:
    """Dispatcher (see the module docstring)."""
    from .cpu import kivi_attention_cpu, use_cpu_kernel
    if use_cpu_kernel(backend, cpp_supported(q, buf, idx is None)):
        return kivi_attention_cpu(q, buf, pos, visible, now, n, scale, idx, valid)
    if resolve_backend(backend, q, buf.k_packed) == "triton":
        from .kivi_int_triton import int_triton_supported, kivi_attention_int_triton, use_int_triton
        from .kivi_triton import kivi_attention_triton, triton_supported
        if idx is None and use_int_triton() and int_triton_supported(q, buf):
            return kivi_attention_int_triton(q, buf, pos, visible, now, n, scale)
        if backend == "triton" or triton_supported(q, buf):
            return kivi_attention_triton(q, buf, pos, visible, now, n, scale, idx, valid)
    return kivi_attention_torch(q, buf, pos, visible, now, n, scale, idx, valid)
