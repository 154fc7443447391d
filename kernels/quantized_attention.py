"""Decode attention straight from a KIVI-packed cache (layout: the docstring of quantize.py).

    quantized_decode_attention(q, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits, group,
                               mask=None, scale=None, *, backend="auto", n_splits=None, block_t=None)
      q         [B, H_q, D] or [B, H_q, 1, D]; query head h reads KV head h // (H_q // H_kv)
      k_packed  [B, H_kv, S, D // P] int32  keys, per-channel codes, P = 32 // bits per word
      k_scale   [B, H_kv, S // G, D]        (k_min alike), G = group, S % G == 0
      v_packed  [B, H_kv, S, D // P] int32  values, per-token codes
      v_scale   [B, H_kv, S, D // G]        (v_min alike)
      n         host int: slots [0, n) are attended (S >= n is the capacity; nothing past n counts)
      mask      bool [B, H_kv or 1, >= n] (True = attend; only [0, n) is read) or None
      scale     softmax scale, default 1/sqrt(D)
      -> (out [B, H_q, D] fp32, lse [B, H_q] fp32): the normalized attention output and the
         log-sum-exp of the scaled scores, so a caller can merge it with other slots
         (`merge_partials`); a row without any visible slot gives out 0 and lse -inf.

Nothing the size of the cache is dequantized on either path:
- Triton kernel: grid (B, H_kv, n_splits); a program takes the G_q query heads of one KV head
  (padded to BLOCK_G >= 16 rows for tl.dot: one read of the packed block serves the whole group)
  and a range of tokens, block by block: load the words, shift/mask the codes, scale and shift
  them in registers, scores by tl.dot, an fp32 online softmax, values alike; the n_splits
  partials are merged by log-sum-exp afterwards.
- torch twin, eager (the CPU path): blocks of `chunk` tokens (whole key groups); each block's
  keys, then values, are dequantized (fp32, transposed [D, tokens]) and multiplied with q / p, so
  the temporaries are one block in size.  (The per-channel identity q.k_t = sum_d (q_d s_{g,d})
  c_{t,d} + sum_d q_d m_{g,d}, which skips dequantizing keys, measured no faster here: the time
  goes into unpacking codes, a dozen small ATen ops per block; eager is ~5x slower than 16-bit.)
- torch twin under torch.compile: one expression per bit-plane j (codes (word >> b*j) & mask are the
  contiguous channels [jW, (j+1)W)), which Inductor fuses into one loop nest that streams the
  words once and keeps only [B, H_q, n]-sized scores; with token-contiguous words (QuantizedKV's
  memory layout) it vectorizes over tokens.  This is the CPU path that beats 16-bit storage.
Any strides are accepted (QuantizedKV passes [.., S, X] views of [.., X, S] buffers).
Backends follow kernels.resolve_backend: "auto" = Triton on CUDA, the torch twin elsewhere;
"triton" on CPU tensors needs TRITON_INTERPRET=1 before the first Triton call.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from . import resolve_backend

triton = tl = None  # imported lazily by _kernels(): importing this module never imports Triton


def _shapes(q, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits, group, mask):
    if q.dim() == 4:
        if q.shape[2] != 1:
            raise ValueError(f"one query token per sequence, got q {tuple(q.shape)}")
        q = q[:, :, 0]
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_q, D] or [B, H_q, 1, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    P = 32 // bits
    if k_packed.dim() != 4 or k_packed.shape[0] != B or k_packed.shape[3] * P != D:
        raise ValueError(f"k_packed must be [B={B}, H_kv, S, D/P={D // P}], got {tuple(k_packed.shape)}")
    H, S = k_packed.shape[1], k_packed.shape[2]
    if Hq % H:
        raise ValueError(f"H_q={Hq} is not a multiple of H_kv={H}")
    if S % group or D % group or not 0 <= n <= S:
        raise ValueError(f"need S={S} and D={D} multiples of the group {group}, and 0 <= n={n} <= S")
    want = {"k_scale": (B, H, S // group, D), "k_min": (B, H, S // group, D), "v_packed": (B, H, S, D // P),
            "v_scale": (B, H, S, D // group), "v_min": (B, H, S, D // group)}
    for name, t in zip(want, (k_scale, k_min, v_packed, v_scale, v_min)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(t.shape)}")
    if k_packed.dtype != torch.int32 or v_packed.dtype != torch.int32:
        raise TypeError("packed words must be int32")
    if torch.compiler.is_compiling():   # (symbolic sizes: checked by the eager calls; a check here breaks the graph)
        return q, B, Hq, H, D, P
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 3 or mask.shape[0] != B
                             or mask.shape[1] not in (1, H) or mask.shape[2] < n):
        raise ValueError(f"mask must be bool [B={B}, H_kv={H} or 1, >= n={n}], got "
                             f"{tuple(mask.shape)} {mask.dtype}")
    return q, B, Hq, H, D, P


def _codes_t(words_t: Tensor, bits: int) -> Tensor:
    """Words [..., W, L] (word index, token) -> fp32 codes [..., D = P * W, L] in channel order.
    One scalar shift per bit-plane j (channels [jW, (j+1)W)): several times faster on CPU than
    one broadcast shift."""
    P, lvl = 32 // bits, (1 << bits) - 1
    out = torch.empty(*words_t.shape[:-2], P, *words_t.shape[-2:], device=words_t.device,
                      dtype=torch.float32)
    for j in range(P):
        out[..., j, :, :] = (words_t >> (bits * j)) & lvl if j else words_t & lvl
    return out.flatten(-3, -2)


def _valid(n: int, total: int, mask: Optional[Tensor], device) -> Tensor:
    """bool [B or 1, H or 1, 1, total]: slot < n and visible."""
    slots = torch.arange(total, device=device)
    ok = (slots < n)[None, None, None]
    if mask is not None:   # no branch on total > n, no tensor of size total - n: compiled graphs stay
        # shape-generic (a size that may be 0 or 1 would be specialized, one graph per n % group)
        m = mask.gather(2, slots.clamp(max=n - 1)[None, None].expand(*mask.shape[:2], total))
        ok = ok & m[:, :, None]
    return ok


def _softmax_stats(s: Tensor) -> tuple[Tensor, Tensor]:
    """Scores with -inf holes -> (p = exp(s - lse), lse); an all -inf row gives p = 0, lse = -inf."""
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p, lse


def _scores_eager(qg, k_packed, k_scale, k_min, nt, bits, G, chunk):
    """Scores [B, H, Gq, nt] of qg [B, H, Gq, D] (scale folded in) against the packed keys of the
    first nt slots (whole groups), block by block in the transposed domain (keys^T [D, tokens])."""
    B, H, Gq, D = qg.shape
    chunk = max(G, chunk // G * G)
    kw = k_packed.transpose(-1, -2)                                        # [B, H, W, S]
    ks, km = k_scale.transpose(-1, -2), k_min.transpose(-1, -2)            # [B, H, D, S/G]
    s = torch.empty(B, H, Gq, nt, device=qg.device, dtype=torch.float32)
    for c0 in range(0, nt, chunk):   # dequantize one block of whole groups, one GEMV
        c1 = min(c0 + chunk, nt)
        g0, g1 = c0 // G, c1 // G
        codes = _codes_t(kw[..., c0:c1], bits).view(B, H, D, g1 - g0, G)
        k_t = codes.mul_(ks[..., g0:g1, None]).add_(km[..., g0:g1, None])   # in place: no copy
        s[..., c0:c1] = torch.matmul(qg, k_t.view(B, H, D, c1 - c0))
    return s


def _values_eager(p, v_packed, v_scale, v_min, n, bits, G, chunk):
    """sum_t p[..., t] v_t over the packed values of slots [0, n): p [B, H, Gq, >= n] -> [B, H, Gq, D]."""
    B, H, Gq = p.shape[:3]
    D = v_packed.shape[-1] * (32 // bits)
    chunk = max(G, chunk // G * G)
    vw = v_packed.transpose(-1, -2)                                        # [B, H, W, S]
    vs, vm = v_scale.transpose(-1, -2), v_min.transpose(-1, -2)            # [B, H, D/G, S]
    out = torch.zeros(B, H, Gq, D, device=p.device, dtype=torch.float32)
    for c0 in range(0, n, chunk):    # per-token scales over channel groups
        c1 = min(c0 + chunk, n)
        codes = _codes_t(vw[..., c0:c1], bits).view(B, H, D // G, G, c1 - c0)
        v_t = codes.mul_(vs[:, :, :, None, c0:c1]).add_(vm[:, :, :, None, c0:c1])
        out += torch.matmul(p[..., c0:c1], v_t.view(B, H, D, c1 - c0).transpose(-1, -2))
    return out


def _torch_eager(qg, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits, G, mask, chunk):
    """Blocks of `chunk` tokens, in the transposed domain (keys^T, values^T [D, tokens])."""
    nt = -(-n // G) * G                                  # whole key groups covering [0, n)
    s = _scores_eager(qg, k_packed, k_scale, k_min, nt, bits, G, chunk)
    s = s.masked_fill(~_valid(n, nt, mask, qg.device), float("-inf"))
    p, lse = _softmax_stats(s)
    return _values_eager(p, v_packed, v_scale, v_min, n, bits, G, chunk), lse


def _scores_fused(qg, k_packed, k_scale, k_min, n, bits, G):
    """The compile-friendly scores [B, H, Gq, nt] (nt = n rounded up to whole groups)."""
    B, H, Gq, D = qg.shape
    P, lvl = 32 // bits, (1 << bits) - 1
    W = D // P
    ng = -(-n // G)
    nt = ng * G
    kw = k_packed.transpose(-1, -2)[:, :, None, :, :nt].view(B, H, 1, W, ng, G)
    qs = qg[:, :, :, None, :] * k_scale[:, :, None, :ng].float()        # [B, H, Gq, ng, D]
    s = (qg[:, :, :, None, :] * k_min[:, :, None, :ng].float()).sum(-1)[..., None]   # [B, H, Gq, ng, 1]
    for j in range(P):
        cj = ((kw >> (bits * j)) & lvl).float()                          # [B, H, 1, W, ng, G]
        qj = qs[..., j * W:(j + 1) * W].transpose(-1, -2)[..., None]     # [B, H, Gq, W, ng, 1]
        s = s + (cj * qj).sum(3)
    return s.reshape(B, H, Gq, nt)


def _values_fused(p, v_packed, v_scale, v_min, n, bits, G):
    """The compile-friendly weighted sum over the packed values of slots [0, n) -> [B, H, Gq, D]."""
    B, H = p.shape[:2]
    P, lvl = 32 // bits, (1 << bits) - 1
    W = v_packed.shape[-1]
    D = W * P
    p = p[:, :, :, None, :n]                                             # [B, H, Gq, 1, n]
    vw = v_packed.transpose(-1, -2)[:, :, None, :, :n]                   # [B, H, 1, W, n]
    rep = (B, H, 1, D // G, G, n)
    vs = v_scale.transpose(-1, -2)[:, :, None, :, None, :n].float().expand(rep).reshape(B, H, 1, D, n)
    vm = v_min.transpose(-1, -2)[:, :, None, :, None, :n].float().expand(rep).reshape(B, H, 1, D, n)
    outs = []
    for j in range(P):
        cj = ((vw >> (bits * j)) & lvl).float()
        sl = slice(j * W, (j + 1) * W)
        outs.append((p * (cj * vs[:, :, :, sl] + vm[:, :, :, sl])).sum(-1))   # [B, H, Gq, W]
    return torch.cat(outs, dim=-1)


def _torch_fused(qg, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits, G, mask):
    """The compile-friendly formulation (see the module docstring): per bit-plane j, the codes
    (word >> b*j) & mask are the channels [jW, (j+1)W) of W words, and scores / outputs are sums
    of P reductions that Inductor fuses into one loop nest over the words, vectorized over
    tokens when the words are token-contiguous (QuantizedKV's layout)."""
    s = _scores_fused(qg, k_packed, k_scale, k_min, n, bits, G)
    s = s.masked_fill(~_valid(n, s.shape[-1], mask, qg.device), float("-inf"))
    p, lse = _softmax_stats(s)
    return _values_fused(p, v_packed, v_scale, v_min, n, bits, G), lse


def quantized_scores(qg: Tensor, k_packed: Tensor, k_scale: Tensor, k_min: Tensor, n: int, bits: int,
                     group: int, chunk: int = 512) -> Tensor:
    """Raw scores qg . k_t of every slot t < n (torch; the pieces of the twin, for callers that need
    the probabilities themselves, e.g. H2O's accumulated attention over a packed cache).
    qg [B, H_kv, Gq, D] fp32 (any softmax scale folded in) -> [B, H_kv, Gq, nt] fp32, nt = n rounded
    up to whole key groups (the slots past n are whatever the words hold: mask them)."""
    if torch.compiler.is_compiling():
        return _scores_fused(qg, k_packed, k_scale, k_min, n, bits, group)
    return _scores_eager(qg, k_packed, k_scale, k_min, -(-n // group) * group, bits, group, chunk)


def quantized_weighted_values(p: Tensor, v_packed: Tensor, v_scale: Tensor, v_min: Tensor, n: int, bits: int,
                              group: int, chunk: int = 512) -> Tensor:
    """sum_t p[..., t] v_t over the packed values of slots t < n (torch): p [B, H_kv, Gq, >= n] fp32
    -> [B, H_kv, Gq, D] fp32."""
    if torch.compiler.is_compiling():
        return _values_fused(p, v_packed, v_scale, v_min, n, bits, group)
    return _values_eager(p, v_packed, v_scale, v_min, n, bits, group, chunk)


def quantized_decode_attention_torch(q: Tensor, k_packed: Tensor, k_scale: Tensor, k_min: Tensor,
                                     v_packed: Tensor, v_scale: Tensor, v_min: Tensor, n: int, bits: int,
                                     group: int, mask: Optional[Tensor] = None,
                                     scale: Optional[float] = None, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """The torch twin (CPU path and reference); see the module docstring.  chunk: tokens per
    block in eager mode (a multiple of the group)."""
    q, B, Hq, H, D, _ = _shapes(q, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits,
                                group, mask)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if n == 0:
        return q.new_zeros(B, Hq, D, dtype=torch.float32), q.new_full((B, Hq), -math.inf, dtype=torch.float32)
    qg = q.float().view(B, H, Hq // H, D) * scale
    args = (qg, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits, group, mask)
    if torch.compiler.is_compiling():
        out, lse = _torch_fused(*args)
    else:
        out, lse = _torch_eager(*args, chunk)
    return out.view(B, Hq, D), lse.view(B, Hq)


# ----------------------------------------------------------------------------------------- Triton
@lru_cache(maxsize=None)
def _kernels():
    global triton, tl
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def qattn_partial(
            Q, KP, KS, KM, VP, VS, VM, MASK, M_PART, L_PART, ACC_PART,
            scale, n, n_per_split, n_splits, Gq,
            sq_b, sq_h, sq_d, skp_b, skp_h, skp_t, skp_w, sks_b, sks_h, sks_g, sks_d,
            skm_b, skm_h, skm_g, skm_d, svp_b, svp_h, svp_t, svp_w, svs_b, svs_h, svs_t, svs_c,
            svm_b, svm_h, svm_t, svm_c, smk_b, smk_h, smk_t,
            D: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, HAS_MASK: tl.constexpr):
        """Program (b, h, split): the Gq query heads of KV head h over the split's tokens."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        gmask = offs_g < Gq
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + (h * Gq + offs_g)[:, None] * sq_h + offs_d[None, :] * sq_d,
                    mask=gmask[:, None], other=0.0).to(tl.float32) * scale
        word = offs_d % W                      # planar layout: channel d = code (d // W) of word d % W
        shift = ((offs_d // W) * BITS).to(tl.int32)
        lvl = (1 << BITS) - 1
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        kp, ks, km = KP + b * skp_b + h * skp_h, KS + b * sks_b + h * sks_h, KM + b * skm_b + h * skm_h
        vp, vs, vm = VP + b * svp_b + h * svp_h, VS + b * svs_b + h * svs_h, VM + b * svm_b + h * svm_h
        start = sp * n_per_split
        end = tl.minimum(start + n_per_split, n)
        for t0 in range(start, end, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tmask = offs_t < end
            m2 = tmask[:, None]
            # keys: per-channel scale/min of group t // GROUP, dequantized in registers
            kw = tl.load(kp + offs_t[:, None] * skp_t + word[None, :] * skp_w, mask=m2, other=0)
            grp = offs_t // GROUP
            k_s = tl.load(ks + grp[:, None] * sks_g + offs_d[None, :] * sks_d, mask=m2, other=0.0)
            k_m = tl.load(km + grp[:, None] * skm_g + offs_d[None, :] * skm_d, mask=m2, other=0.0)
            k = ((kw >> shift[None, :]) & lvl).to(tl.float32) * k_s.to(tl.float32) + k_m.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")             # [BLOCK_G, BLOCK_T]
            ok = tmask
            if HAS_MASK:
                vis = tl.load(MASK + b * smk_b + h * smk_h + offs_t * smk_t, mask=tmask, other=0)
                ok = ok & (vis != 0)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # values: per-token scale/min of channel group d // GROUP
            vw = tl.load(vp + offs_t[:, None] * svp_t + word[None, :] * svp_w, mask=m2, other=0)
            cg = offs_d // GROUP
            v_s = tl.load(vs + offs_t[:, None] * svs_t + cg[None, :] * svs_c, mask=m2, other=0.0)
            v_m = tl.load(vm + offs_t[:, None] * svm_t + cg[None, :] * svm_c, mask=m2, other=0.0)
            v = ((vw >> shift[None, :]) & lvl).to(tl.float32) * v_s.to(tl.float32) + v_m.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        row = ((b * tl.num_programs(1) + h) * n_splits + sp) * BLOCK_G + offs_g
        tl.store(M_PART + row, m_i)
        tl.store(L_PART + row, l_i)
        tl.store(ACC_PART + row[:, None] * D + offs_d[None, :], acc)

    return qattn_partial


def _auto_splits(device: torch.device, programs: int, n_blocks: int) -> int:
    """About 2 programs per SM on CUDA; 1 split elsewhere (the interpreter); never > blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    return max(1, min(n_blocks, -(-2 * sms // programs)))


def quantized_decode_attention_triton(q: Tensor, k_packed: Tensor, k_scale: Tensor, k_min: Tensor,
                                      v_packed: Tensor, v_scale: Tensor, v_min: Tensor, n: int, bits: int,
                                      group: int, mask: Optional[Tensor] = None, scale: Optional[float] = None,
                                      n_splits: Optional[int] = None,
                                      block_t: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """The Triton kernel (+ a log-sum-exp merge of the splits in torch).  n_splits: programs per
    (batch row, KV head) (default: enough to fill the GPU); block_t: tokens per inner step
    (default 64 for D <= 64, else 32).  D must be a power of two >= 16 (64, 128)."""
    q, B, Hq, H, D, P = _shapes(q, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits,
                                group, mask)
    if D < 16 or D & (D - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {D}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    Gq = Hq // H
    if n == 0:
        return q.new_zeros(B, Hq, D, dtype=torch.float32), q.new_full((B, Hq), -math.inf, dtype=torch.float32)
    BLOCK_T = block_t or (64 if D <= 64 else 32)
    BLOCK_G = max(16, 1 << (Gq - 1).bit_length())
    n_blocks = -(-n // BLOCK_T)
    n_splits = n_splits or _auto_splits(q.device, B * H, n_blocks)
    n_splits = max(1, min(int(n_splits), n_blocks))
    n_per_split = -(-n_blocks // n_splits) * BLOCK_T
    n_splits = -(-n // n_per_split)                                       # no empty trailing split
    f32 = {"device": q.device, "dtype": torch.float32}
    m_part = torch.empty(B, H, n_splits, BLOCK_G, **f32)
    l_part = torch.empty(B, H, n_splits, BLOCK_G, **f32)
    acc_part = torch.empty(B, H, n_splits, BLOCK_G, D, **f32)
    vis = k_packed[:, :, :1, 0] if mask is None else mask.view(torch.uint8)
    mask_strides = (0, 0, 0) if mask is None else (vis.stride(0), vis.stride(1) if vis.shape[1] > 1 else 0,
                                                   vis.stride(2))
    _kernels()[(B, H, n_splits)](
        q, k_packed, k_scale, k_min, v_packed, v_scale, v_min, vis, m_part, l_part, acc_part,
        scale, n, n_per_split, n_splits, Gq,
        *q.stride(), *k_packed.stride(), *k_scale.stride(), *k_min.stride(),
        *v_packed.stride(), *v_scale.stride(), *v_min.stride(), *mask_strides,
        D=D, W=D // P, BITS=bits, GROUP=group, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, HAS_MASK=mask is not None)
    m, l, acc = m_part[..., :Gq], l_part[..., :Gq], acc_part[..., :Gq, :]   # [B, H, splits, Gq(, D)]
    mx = m.amax(2, keepdim=True)
    w = torch.exp(m - torch.where(torch.isinf(mx), 0.0, mx))
    total = (w * l).sum(2)                                                # [B, H, Gq]
    out = (w[..., None] * acc).sum(2) / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = torch.where(total > 0, torch.log(total) + torch.where(torch.isinf(mx), 0.0, mx)[:, :, 0],
                      -math.inf)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def quantized_decode_attention(q: Tensor, k_packed: Tensor, k_scale: Tensor, k_min: Tensor,
                               v_packed: Tensor, v_scale: Tensor, v_min: Tensor, n: int, bits: int,
                               group: int, mask: Optional[Tensor] = None, scale: Optional[float] = None, *,
                               backend: str = "auto", n_splits: Optional[int] = None,
                               block_t: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Dispatcher: Triton on CUDA tensors (or backend="triton" under TRITON_INTERPRET=1), else the
    torch twin (see the module docstring)."""
    args = (q, k_packed, k_scale, k_min, v_packed, v_scale, v_min, n, bits, group, mask, scale)
    if resolve_backend(backend, q, k_packed, v_packed) == "triton":
        return quantized_decode_attention_triton(*args, n_splits=n_splits, block_t=block_t)
    return quantized_decode_attention_torch(*args)


def merge_partials(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention over two disjoint slot sets from their partials: out [..., D] and lse [...]
    (fp32).  A side with lse -inf (nothing visible) contributes nothing; both -inf gives 0, -inf."""
    lse = torch.logaddexp(lse1, lse2)
    ref = torch.where(torch.isinf(lse), 0.0, lse)
    out = out1 * torch.exp(lse1 - ref)[..., None] + out2 * torch.exp(lse2 - ref)[..., None]
    return out, lse
