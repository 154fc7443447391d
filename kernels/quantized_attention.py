"""Scores and weighted values straight from KIVI-packed words (layout: the docstring of kernels/kivi_codec.py),
the torch pieces of kernels/kivi_attention.py's twin and of the policies that need the attention
probabilities themselves (H2O, D2O over packed storage).

    quantized_scores(qg, k_packed, k_scale, k_min, n, bits, group)            -> [B, H_kv, Gq, nt]
    quantized_weighted_values(p, v_packed, v_scale, v_min, n, bits, group)    -> [B, H_kv, Gq, D]

      qg        [B, H_kv, Gq, D] fp32 queries (the softmax scale folded in)
      k_packed  [B, H_kv, S, D // P] int32  keys, per-channel codes, P = 32 // bits per word
      k_scale   [B, H_kv, S // G, D]        (k_min alike), G = group
      v_packed  [B, H_kv, S, D // P] int32  values, per-token codes
      v_scale   [B, H_kv, S, D // G]        (v_min alike)
      n         host int: slots [0, n) count

Nothing the size of the cache is dequantized: eagerly (the CPU path) blocks of `chunk` tokens (whole
key groups) are dequantized in the transposed domain and multiplied with q / p, so temporaries are
one block in size; under torch.compile one expression per bit-plane j (codes (word >> b*j) & mask are
the contiguous channels [jW, (j+1)W)) that Inductor fuses into one loop nest streaming the words once.
"""
from __future__ import annotations

import torch
from torch import Tensor


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
