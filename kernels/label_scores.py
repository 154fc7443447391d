"""Critical-token selection from a label cache (Double Sparsity / HShare): approximate scores,
sink/recent masking, top-k.

Label cache: per layer `labels [B, H_kv, S, C]`, the C heavy channels of every cached key (post-RoPE),
written as keys are cached; or 4-bit: `packed [B, H_kv, S, C//2]` uint8 + per-token `scale, minimum
[B, H_kv, S]` (see quantize_labels_4bit).  The query's label `q_label [B, H_q, C]` is query head h
restricted to the heavy channels of its KV head h // G (the label cache has one channel set per KV
head, so all heads of a group use the same channels).

    scores = approx_scores(q_label, labels, [scale, minimum], group="kv", length=L, n_sink=x, n_recent=y)
    idx, valid = select_critical(scores, x + y + z, return_valid=True)
    out = sparse_decode_attention(q, k_cache, v_cache, idx, valid)

GQA reduction (group="kv", a selection shared by the G query heads of a KV head): the group's scores
are **summed** (equivalently, the group's query labels are summed first and dotted once per key, which
is what both backends do: the reduction costs nothing per key).  Summing approximate logits ranks like
their mean (the design doc's group mean) and needs no per-head softmax over S; a caller that wants a
mean of per-head softmax probabilities asks for group="query" ([B, H_q, S]) and reduces itself.
Scores are raw dot products (no 1/sqrt(D)): only their order matters.

Masking (mask_sink_recent, or fused into approx_scores when `length` is given): for a sequence holding
`length` tokens in slots 0..length-1 (the current token at length-1), slots < n_sink, slots >= length -
n_recent and slot length-1 get +inf (top-k always keeps them), slots >= length get -inf.  Hence
n_critical >= n_sink + max(n_recent, 1) keeps every forced token, and when length < n_critical some
selected entries point at empty slots: select_critical(..., return_valid=True) flags them.
"""
from functools import lru_cache
from typing import Optional, Union

import torch
from torch import Tensor

from .backend import resolve_backend
from .cpu import label_scores_cpu, label_scores_supported, use_cpu_kernel

triton = tl = None  # imported lazily by _kernels()

INF = float("inf")


# ------------------------------------------------------------------------------- 4-bit labels
def pack_4bit(codes: Tensor) -> Tensor:
    """uint8 codes in [0, 15], [..., C] (C even) -> [..., C//2]: byte j = code 2j | code 2j+1 << 4."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even channel count, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_4bit(packed: Tensor) -> Tensor:
    """[..., C//2] uint8 -> codes [..., C] uint8 (exact inverse of pack_4bit)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def quantize_labels_4bit(labels: Tensor, param_dtype: torch.dtype = torch.float16):
    """Asymmetric per-token 4-bit quantization along C: labels [..., C] ->
    (packed uint8 [..., C//2], scale [...], minimum [...]) with scale/minimum in `param_dtype`.

    label ~= code * scale + minimum with |error| <= scale / 2: minimum is rounded down and scale up
    to `param_dtype` before the codes are computed, so every code lies in [0, 15].  A constant token
    gets scale 0 and codes 0 (dequantized exactly to its value; no NaN)."""
    x = labels.float()
    lo, hi = x.amin(-1), x.amax(-1)
    mn = lo.to(param_dtype)
    mn = torch.where(mn.float() > lo, torch.nextafter(mn, torch.full_like(mn, -INF)), mn)
    sc = ((hi - mn.float()) / 15).to(param_dtype)
    sc = torch.where(mn.float() + 15 * sc.float() < hi, torch.nextafter(sc, torch.full_like(sc, INF)), sc)
    scf = sc.float()[..., None]
    q = torch.where(scf > 0, (x - mn.float()[..., None]) / torch.where(scf > 0, scf, 1.0), 0.0)
    codes = q.round().clamp_(0, 15).to(torch.uint8)
    return pack_4bit(codes), sc, mn


def dequantize_labels_4bit(packed: Tensor, scale: Tensor, minimum: Tensor,
                           dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed [..., C//2], scale [...], minimum [...]) -> labels [..., C] in `dtype`."""
    codes = unpack_4bit(packed).float()
    return (codes * scale.float()[..., None] + minimum.float()[..., None]).to(dtype)


# ------------------------------------------------------------------------------- shapes
def _label_shapes(q_label: Tensor, labels: Tensor, scale: Optional[Tensor], minimum: Optional[Tensor],
                  group: str):
    if group not in ("kv", "query"):
        raise ValueError(f"group must be 'kv' or 'query', got {group!r}")
    if q_label.dim() != 3 or labels.dim() != 4 or labels.shape[0] != q_label.shape[0]:
        raise ValueError(f"q_label must be [B, H_q, C] and labels [B, H_kv, S, C (or C//2 packed)], "
                         f"got {tuple(q_label.shape)} and {tuple(labels.shape)}")
    B, Hq, C = q_label.shape
    _, Hkv, S, Cl = labels.shape
    if Hq % Hkv:
        raise ValueError(f"H_q={Hq} is not a multiple of H_kv={Hkv}")
    packed = labels.dtype == torch.uint8
    if packed:
        if scale is None or minimum is None:
            raise ValueError("packed 4-bit labels need label_scale and label_min [B, H_kv, S]")
        if scale.shape != labels.shape[:3] or minimum.shape != labels.shape[:3]:
            raise ValueError(f"label_scale/label_min must be {tuple(labels.shape[:3])}")
        if C != 2 * Cl:
            raise ValueError(f"q_label has C={C} channels, packed labels hold {2 * Cl}")
    elif Cl != C:
        raise ValueError(f"q_label has C={C} channels, labels hold {Cl}")
    return B, Hq, Hkv, S, C, packed


def _length_tensor(length: Union[int, Tensor], B: int, device) -> Tensor:
    if isinstance(length, Tensor):
        if length.shape != (B,):
            raise ValueError(f"length must be an int or a [B={B}] tensor, got {tuple(length.shape)}")
        return length.to(device=device, dtype=torch.int64)
    return torch.full((B,), int(length), dtype=torch.int64, device=device)


# ------------------------------------------------------------------------------- torch twins
def mask_sink_recent_torch(scores: Tensor, n_sink: int, n_recent: int, length: Union[int, Tensor],
                           inplace: bool = False) -> Tensor:
    """scores [B, ..., S] -> a masked copy, or `scores` masked in place (see the module docstring)."""
    S = scores.shape[-1]
    pos = torch.arange(S, device=scores.device)
    if isinstance(length, Tensor):
        length = length.to(scores.device).view(-1, *([1] * (scores.dim() - 1)))
    force = (pos < n_sink) | (pos >= length - n_recent) | (pos == length - 1)
    out = scores if inplace else scores.clone()
    return out.masked_fill_(force, INF).masked_fill_(pos >= length, -INF)


def approx_scores_torch(q_label: Tensor, labels: Tensor, label_scale: Optional[Tensor] = None,
                        label_min: Optional[Tensor] = None, *, group: str = "kv",
                        length: Union[int, Tensor, None] = None, n_sink: int = 0,
                        n_recent: int = 0) -> Tensor:
    """The torch twin of approx_scores (CPU path and reference)."""
    B, Hq, Hkv, S, C, packed = _label_shapes(q_label, labels, label_scale, label_min, group)
    G = Hq // Hkv
    qg = q_label.float().view(B, Hkv, G, C)
    if group == "kv":
        qg = qg.sum(2, keepdim=True)                                   # [B, Hkv, 1, C]
    if packed:
        lo, hi = (labels & 15).float(), (labels >> 4).float()          # [B, Hkv, S, C//2]
        dot = (torch.matmul(qg[..., 0::2], lo.transpose(-1, -2))
               + torch.matmul(qg[..., 1::2], hi.transpose(-1, -2)))
        s = label_scale.float()[:, :, None] * dot + label_min.float()[:, :, None] * qg.sum(-1, keepdim=True)
    else:
        s = torch.matmul(qg, labels.float().transpose(-1, -2))         # [B, Hkv, g, S]
    s = s.reshape(B, -1, S)
    if length is not None:
        s = mask_sink_recent_torch(s, n_sink, n_recent, length, inplace=True)   # s is ours
    return s


# ------------------------------------------------------------------------------- Triton
@lru_cache(maxsize=None)
def _kernels():
    global triton, tl
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def approx_scores_kernel(
            QL, LAB, SCALE, MIN, LEN, OUT, S, G, n_sink, n_recent,
            sq_b, sq_h, sq_c, sl_b, sl_h, sl_s, sl_c, ss_b, ss_h, ss_s, sn_b, sn_h, sn_s, so_b, so_h, so_s,
            NC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
            GROUP_SUM: tl.constexpr, PACKED: tl.constexpr, HAS_LEN: tl.constexpr):
        """Program (b, h, s-block).  GROUP_SUM: h is a KV head and the query labels of its G heads are
        summed (BLOCK_G >= G rows); else h is a query head (BLOCK_G = 1) reading KV head h // G.
        PACKED: NC = C // 2 bytes per token, nibbles unpacked in registers, score =
        scale * (q_even . lo + q_odd . hi) + minimum * sum(q)."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs_s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = offs_s < S
        offs_g = tl.arange(0, BLOCK_G)
        offs_c = tl.arange(0, BLOCK_C)
        cmask = offs_c < NC
        if GROUP_SUM:
            kvh = h
            qh = h * G + offs_g
            gmask = offs_g < G
        else:
            kvh = h // G
            qh = h + offs_g
            gmask = offs_g < 1
        q_ptr = QL + b * sq_b + qh[:, None] * sq_h
        lab = tl.load(LAB + b * sl_b + kvh * sl_h + offs_s[:, None] * sl_s + offs_c[None, :] * sl_c,
                      mask=smask[:, None] & cmask[None, :], other=0)
        qm = gmask[:, None] & cmask[None, :]
        if PACKED:
            q_even = tl.load(q_ptr + (2 * offs_c[None, :]) * sq_c, mask=qm, other=0.0)
            q_odd = tl.load(q_ptr + (2 * offs_c[None, :] + 1) * sq_c, mask=qm, other=0.0)
            q_even = tl.sum(q_even.to(tl.float32), 0)
            q_odd = tl.sum(q_odd.to(tl.float32), 0)
            lo = (lab & 15).to(tl.float32)
            hi = (lab >> 4).to(tl.float32)
            dot = tl.sum(lo * q_even[None, :] + hi * q_odd[None, :], 1)
            sc = tl.load(SCALE + b * ss_b + kvh * ss_h + offs_s * ss_s, mask=smask, other=0.0).to(tl.float32)
            mn = tl.load(MIN + b * sn_b + kvh * sn_h + offs_s * sn_s, mask=smask, other=0.0).to(tl.float32)
            s = sc * dot + mn * tl.sum(q_even + q_odd, 0)
        else:
            q = tl.sum(tl.load(q_ptr + offs_c[None, :] * sq_c, mask=qm, other=0.0).to(tl.float32), 0)
            s = tl.sum(lab.to(tl.float32) * q[None, :], 1)
        if HAS_LEN:
            L = tl.load(LEN + b)   # same masking as mask_kernel (a nested jit helper would be a closure)
            s = tl.where((offs_s < n_sink) | (offs_s >= L - n_recent) | (offs_s == L - 1), float("inf"), s)
            s = tl.where(offs_s >= L, float("-inf"), s)
        tl.store(OUT + b * so_b + h * so_h + offs_s * so_s, s, mask=smask)

    @triton.jit
    def mask_kernel(X, LEN, OUT, S, n_sink, n_recent, sx_b, sx_r, sx_s, so_b, so_r, so_s,
                    BLOCK_S: tl.constexpr):
        """Program (b, row, s-block) of scores viewed as [B, R, S]."""
        b = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        offs_s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = offs_s < S
        x = tl.load(X + b * sx_b + r * sx_r + offs_s * sx_s, mask=smask, other=0.0)
        L = tl.load(LEN + b)
        x = tl.where((offs_s < n_sink) | (offs_s >= L - n_recent) | (offs_s == L - 1), float("inf"), x)
        x = tl.where(offs_s >= L, float("-inf"), x)
        tl.store(OUT + b * so_b + r * so_r + offs_s * so_s, x.to(OUT.dtype.element_ty), mask=smask)

    return approx_scores_kernel, mask_kernel


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def approx_scores_triton(q_label: Tensor, labels: Tensor, label_scale: Optional[Tensor] = None,
                         label_min: Optional[Tensor] = None, *, group: str = "kv",
                         length: Union[int, Tensor, None] = None, n_sink: int = 0, n_recent: int = 0,
                         block_s: int = 128) -> Tensor:
    """The Triton kernel of approx_scores (masking fused when `length` is given)."""
    B, Hq, Hkv, S, C, packed = _label_shapes(q_label, labels, label_scale, label_min, group)
    G = Hq // Hkv
    Hout = Hkv if group == "kv" else Hq
    out = torch.empty((B, Hout, S), dtype=torch.float32, device=labels.device)
    n_cols = labels.shape[-1]
    lens = _length_tensor(length, B, labels.device) if length is not None else out
    sc = label_scale if packed else out
    mn = label_min if packed else out
    kernel, _ = _kernels()
    kernel[(B, Hout, triton.cdiv(S, block_s))](
        q_label, labels, sc, mn, lens, out, S, G, int(n_sink), int(n_recent),
        *q_label.stride(), *labels.stride(), *sc.stride()[:3], *mn.stride()[:3], *out.stride(),
        NC=n_cols, BLOCK_C=_next_pow2(n_cols), BLOCK_S=block_s,
        BLOCK_G=_next_pow2(G) if group == "kv" else 1,
        GROUP_SUM=group == "kv", PACKED=packed, HAS_LEN=length is not None)
    return out


def mask_sink_recent_triton(scores: Tensor, n_sink: int, n_recent: int, length: Union[int, Tensor],
                            block_s: int = 256) -> Tensor:
    B, S = scores.shape[0], scores.shape[-1]
    x = scores.reshape(B, -1, S)
    out = torch.empty_like(x)
    _, kernel = _kernels()
    kernel[(B, x.shape[1], triton.cdiv(S, block_s))](
        x, _length_tensor(length, B, scores.device), out, S, int(n_sink), int(n_recent),
        *x.stride(), *out.stride(), BLOCK_S=block_s)
    return out.view(scores.shape)


# ------------------------------------------------------------------------------- dispatchers
def approx_scores(q_label: Tensor, labels: Tensor, label_scale: Optional[Tensor] = None,
                  label_min: Optional[Tensor] = None, *, group: str = "kv",
                  length: Union[int, Tensor, None] = None, n_sink: int = 0, n_recent: int = 0,
                  backend: str = "auto") -> Tensor:
    """Approximate scores q_label . label for every slot -> fp32 [B, H_kv, S] (group="kv": summed
    over the G query heads of each KV head) or [B, H_q, S] (group="query").

    q_label [B, H_q, C]; labels [B, H_kv, S, C] (any float dtype) or uint8 [B, H_kv, S, C//2] with
    label_scale, label_min [B, H_kv, S] (quantize_labels_4bit).  With `length` (int or [B]) the result
    is also masked as mask_sink_recent(scores, n_sink, n_recent, length) does (fused in Triton).  On CPU
    the C++ kernel (kvc::label_scores, kernels/cpu_labels.cpp) runs where it is built and takes the tensors."""
    if resolve_backend(backend, q_label, labels) == "triton":
        return approx_scores_triton(q_label, labels, label_scale, label_min, group=group, length=length,
                                    n_sink=n_sink, n_recent=n_recent)
    if use_cpu_kernel(backend, label_scores_supported(q_label, labels)):
        _label_shapes(q_label, labels, label_scale, label_min, group)
        s = label_scores_cpu(q_label, labels, label_scale, label_min, group == "kv")
        return s if length is None else mask_sink_recent_torch(s, n_sink, n_recent, length, inplace=True)
    return approx_scores_torch(q_label, labels, label_scale, label_min, group=group, length=length,
                               n_sink=n_sink, n_recent=n_recent)


def mask_sink_recent(scores: Tensor, n_sink: int, n_recent: int, length: Union[int, Tensor], *,
                     backend: str = "auto") -> Tensor:
    """scores [B, ..., S] -> copy with slots < n_sink, >= length - n_recent and == length - 1 set to
    +inf and slots >= length set to -inf; length is an int or a [B] tensor (tokens held, the current
    one included)."""
    if resolve_backend(backend, scores) == "triton":
        return mask_sink_recent_triton(scores, n_sink, n_recent, length)
    return mask_sink_recent_torch(scores, n_sink, n_recent, length)


def select_critical(scores: Tensor, n_critical: int, return_valid: bool = False):
    """Top-n_critical slots of masked scores [..., S] -> idx [..., n_critical] (int64, unsorted), and
    with return_valid=True also valid [..., n_critical] (False where a -inf slot had to be taken
    because fewer than n_critical slots are filled).  Needs n_critical <= S (static shapes)."""
    vals, idx = torch.topk(scores, n_critical, dim=-1, sorted=False)
    return (idx, vals > -INF) if return_valid else idx
