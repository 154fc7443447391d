"""KIVI decode attention in integer arithmetic: the torch twin of kvc::kivi_attention's integer dense path
(kernels/kivi_kernels.cpp, arith "vnni" or "avx2"; kernels/cpu.py `kivi_attention_cpu` picks it), the
twin of its Triton kernel (kernels/kivi_int_triton.py, "Triton" below), and the scheme stated once.

    kivi_attention_int_torch(q, buf, pos, visible, now, n, scale=None) -> out
        the dense read of kernels.kivi_attention.kivi_attention (same arguments and residual rule):
        q [B, H_q, D] or [B, H_q, 1, D], buf KIVIBuffers of 2- or 4-bit storage, G = buf.group

Shapes: H KV heads, Gq = H_q / H query rows per KV head, ne = n rounded up to whole slot groups,
ng = ne / G, NCG = D / G value channel groups, c(d) = d // G; codes ck, cv [B, H, ne, D] in [0, 2^b).
Keys (scale s_k, minimum m_k [B, H, ng, D], per channel over the G slots of a group):
    qg  = q * scale                                             [B, H, Gq, D]        fp32
    qs  = qg * s_k[g]                                           [B, H, Gq, ng, D]    fp32
    a   = max_d |qs| / 127,  qi = round(qs * 127 / max_d |qs|)  int8 in [-127, 127]  (0 where qs == 0)
    z   = qg . m_k[g]                                           [B, H, Gq, ng]       fp32
    S_t = sum_d qi[g(t), d] ck[t, d]                            int32, |S| <= 127 * 15 * D
    s_t = S_t * a + z (one fused multiply-add); keys in the ring: qg . k_ring (fp32); not visible: -inf
Softmax: m = max_t s_t (0 when nothing is visible), e_t = exp(s_t - m), l = sum_t e_t.
Values (scale s_v, minimum m_v [B, H, ne, NCG], per token over G channels); slots whose value is in
the ring contribute e_t v_ring in fp32 and take e_t = 0 below:
    pv  = e_t * s_v[t, c]                                       [B, H, Gq, ne, NCG]  fp32 >= 0
    per (query row, slot group, channel group, lane block: the slots t of the group with t mod 16 in
    [4 blk, 4 blk + 4), G / 4 slots): b = max_t pv * fp32(1 / 255), pw = round(pv * 255 / max_t pv)  uint8
    V_d = sum_{groups, blocks} b[c(d)] * sum_{t in block} pw[t, c(d)] cv[t, d]   (inner sums int32)
    out = (V + sum_t e_t m_v[t, c(d)] + sum_ring e_t v_ring[t]) / l
The products are u8 x s8 (codes x int8 query; u8 weights x codes): AVX-512 VNNI's vpdpbusd sums four
into an int32 lane; AVX2's vpmaddubsw sums pairs into int16 (at most 2 * 255 * 15 = 7650 and
2 * 15 * 127 = 3810: never saturated) and vpmaddwd the pairs into int32, so both give the same
integer sums and this one twin is the reference of both.

Triton (kernels/kivi_int_triton.py; twin kivi_attention_int_triton_torch): the same keys (qi, S, a per
head and key group; S from int8 tensor-core dots), but the kernel keeps an online softmax over blocks
of G slots, so its weights are quantized against each block's own maximum:
    u_t = S_t * a (one fp32 product), s_t = u_t + z; per (row, slot group) over the slots whose value
    is packed (visible, not in the value ring): mu = max_t u_t, e_t = vexp(u_t - mu)
    per (row, slot group, channel group), all G slots: b = max_t pv / 255, pw = round(pv * 255 / max_t pv)
    block = exp(mu + z - m) * (b * sum_t pw cv + sum_t e_t m_v)        (summed over slot groups)
    l = sum_groups exp(mu + z - m) sum_t e_t + sum_ring exp(s_t - m)
The codes depend on u_t - mu only (not on z, the running maximum or the ring keys), and every fp32
step before them is exactly rounded in both (products, divisions (div_rn), round half to even, vexp's
fused steps; the kernel runs with fp fusion off), so both round to the same codes; the rest is a
continuous function of them and the twin computes it in float64.  sum_t pw cv runs as an fp16 dot
with fp32 accumulation: integers below 2^24 (255 * 15 * G), so exact, and fp16 dots take K = 16.

Exactness: every 8-bit code depends on fp32 values, so the twin computes those in the kernel's
order: qs, the scales and the roundings as above; z and the ring keys' scores as the kernel's
`dot` (16 lanes of fused multiply-adds, then cpu_vec.h's hsum tree: `lane_dot`); s_t with one
fused multiply-add; e_t with cpu_vec.h's `vexp` polynomial step by step (`vexp`).  A fused a * b + c
is computed in float64 and rounded once to fp32 (exact but for double rounding, ~2^-29 a call).
The sums after the last rounding (l, the value sums) differ from the kernel's by float rounding.

Error against the fp32-arithmetic op over the same codes (kernels.kivi_attention_torch; measured
2026-11-25, tests/test_kivi_int.py): rms(int - fp32) is 0.14-0.21x KIVI's own error rms(fp32 - exact)
at 4 bits and 0.03-0.04x at 2 bits (random caches, 300 and 2000 tokens; max |int - fp32| <= 6e-2 with
values ~ N(0, 1)), mostly from the int8 query.  The default model's perplexity (2048 + 256 tokens, `full`):
4 bits 22.044 integer against 22.065 fp32 arithmetic (-0.10%), 2 bits 23.934 against 24.198 (-1.1%);
16-bit storage 22.110.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .kivi_attention import KIVIBuffers, ring_flags, ring_rows, whole_groups
from .kivi_codec import unpack

QMAX, WMAX = 127, 255          # int8 query codes, uint8 weights


def _f32(x) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.float32)


def fma(a, b, c) -> Tensor:
    """a * b + c rounded once to fp32 (the float64 product of two fp32 values is exact)."""
    return (_f32(a).double() * _f32(b).double() + _f32(c).double()).float()


def _inverse(x: Tensor, top: int) -> Tensor:
    """top / x as the kernel divides (one IEEE division; `top / x` would be x.reciprocal() * top), 0 where
    x == 0."""
    return torch.where(x > 0, torch.full_like(x, top) / x, 0.0)


def lane_dot(a: Tensor, b: Tensor) -> Tensor:
    """kernels/kivi_kernels.cpp `dot` over the last dim (a multiple of 16): lane l accumulates
    a[16 j + l] b[16 j + l] over j with fused multiply-adds, then the lanes are summed by cpu_vec.h's
    hsum tree.  [..., D] x [..., D] (broadcast) -> [...] fp32."""
    a, b = torch.broadcast_tensors(a, b)
    acc = torch.zeros(a.shape[:-1] + (16,), dtype=torch.float32, device=a.device)
    for j in range(0, a.shape[-1], 16):
        acc = fma(a[..., j:j + 16], b[..., j:j + 16], acc)
    for h in (8, 4, 2, 1):
        acc = acc[..., :h] + acc[..., h:2 * h]
    return acc[..., 0]


def vexp(x: Tensor) -> Tensor:
    """cpu_vec.h's `vexp`, step by step (its a * b + c steps fused, as the compiler contracts them)."""
    under = x < _f32(-87.3)
    x = torch.where(x > _f32(88.3), _f32(88.3), x)
    x = torch.where(under, _f32(0.0), x)
    t = fma(x, 1.44269504088896341, 0.5)
    n = t.to(torch.int32)                                               # toward zero
    n = n - (n.float() > t).to(torch.int32)                             # floor
    nf = n.float()
    x = fma(-nf, 0.693359375, x)
    x = fma(nf, 2.12194440e-4, x)
    y = fma(1.9875691500e-4, x, 1.3981999507e-3)
    for c in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = fma(y, x, c)
    y = fma(y * x, x, x) + 1.0
    r = y * ((n + 127) << 23).view(torch.float32)
    return torch.where(under, _f32(0.0), r)


def key_dots(qg: Tensor, buf: KIVIBuffers, ne: int) -> tuple[Tensor, Tensor]:
    """(S, a) of the module docstring for slots [0, ne): qg [B, H, Gq, D] -> S [B, H, Gq, ng, G] float64
    (exact integers), a [B, H, Gq, ng, 1] fp32."""
    B, H, Gq, D = qg.shape
    G = buf.group
    ng = ne // G
    qs = qg[:, :, :, None, :] * buf.k_scale[:, :, None, :ng].float()               # [B, H, Gq, ng, D]
    amax = qs.abs().amax(-1, keepdim=True)
    qi = (qs * _inverse(amax, QMAX)).round()
    ck = unpack(buf.k_packed[:, :, :ne], buf.bits, -1).view(B, H, 1, ng, G, D).double()
    return (ck @ qi.double()[..., None])[..., 0], amax / QMAX


def int_scores(qg: Tensor, buf: KIVIBuffers, ne: int) -> Tensor:
    """S_t * a + z of the module docstring for slots [0, ne): qg [B, H, Gq, D] -> [B, H, Gq, ne] fp32."""
    B, H, Gq, _ = qg.shape
    S, a = key_dots(qg, buf, ne)
    z = lane_dot(qg[:, :, :, None, :], buf.k_min[:, :, None, :ne // buf.group].float())   # [B, H, Gq, ng]
    return fma(S, a.double(), z[..., None].double()).view(B, H, Gq, ne)


def int_values(e: Tensor, buf: KIVIBuffers, ne: int) -> Tensor:
    """sum_t e_t v_t over the packed values of slots [0, ne) with the weights quantized per (row, slot
    group, lane block, channel group) as in the module docstring: e [B, H, Gq, ne] -> [B, H, Gq, D] fp32
    (not divided by l; float64 after the last rounding)."""
    B, H, Gq, _ = e.shape
    G, bits = buf.group, buf.bits
    ng, VG = ne // G, G // 16
    vs, vm = buf.v_scale[:, :, :ne].float(), buf.v_min[:, :, :ne].float()         # [B, H, ne, NCG]
    pv = (e[..., None] * vs[:, :, None]).view(B, H, Gq, ng, VG, 4, 4, -1)          # slot = 16 v + 4 blk + m
    pmax = pv.amax((4, 6), keepdim=True)                                           # [B, H, Gq, ng, 1, 4, 1, NCG]
    pw = (pv * _inverse(pmax, WMAX)).round()
    cv = unpack(buf.v_packed[:, :, :ne], bits, -1).view(B, H, 1, ng, VG, 4, 4, -1, G).double()
    sums = (pw.double()[..., None] * cv).sum((4, 6))                              # [B, H, Gq, ng, 4, NCG, G] exact
    out = (sums * (pmax * _f32(1.0 / WMAX)).double()[:, :, :, :, 0, :, 0, :, None]).sum((3, 4))  # [B, H, Gq, NCG, G]
    minimums = (e.double()[..., None] * vm.double()[:, :, None]).sum(3)            # [B, H, Gq, NCG]
    return (out + minimums[..., None]).flatten(-2)


def _dense_reads(q: Tensor, buf: KIVIBuffers, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int,
                 scale: Optional[float]):
    """What both twins start from: qg [B, H, Gq, D] (q * scale, fp32), p [B, H or 1, ne] (whole groups),
    vis and the ring flags [B, H or 1, 1, ne], ne."""
    if buf.bits not in (2, 4):
        raise ValueError(f"integer KIVI attention needs 2- or 4-bit storage, got {buf.bits} bits")
    q3 = q[:, :, 0] if q.dim() == 4 else q
    B, Hq, D = q3.shape
    H, R = buf.k_packed.shape[1], buf.residual
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q3.float().view(B, H, Hq // H, D) * scale
    p, ne = whole_groups(pos, n, buf.group, -1)
    seen = torch.ones_like(pos[..., :n], dtype=torch.bool) if visible is None else visible
    vis = whole_groups(seen, n, buf.group, False)[0][:, :, None]
    key_exact, value_exact = (f[:, :, None] for f in ring_flags(p, now, R))       # [B, H or 1, 1, ne]
    return qg, p, ne, vis, key_exact, value_exact


def _finish(out: Tensor, l: Tensor, q: Tensor) -> Tensor:
    """out [B, H, Gq, D], l [B, H, Gq, 1] float64 -> out / l (0 where nothing is visible) shaped and typed as q."""
    out = torch.where(l > 0, out / l, 0.0).float().reshape(q.shape[0], q.shape[1], -1).to(q.dtype)
    return out.unsqueeze(2) if q.dim() == 4 else out


def kivi_attention_int_torch(q: Tensor, buf: KIVIBuffers, pos: Tensor, visible: Optional[Tensor], now: Tensor,
                             n: int, scale: Optional[float] = None) -> Tensor:
    """The twin (module docstring): dense reads of slots [0, n) -> [B, H_q, D] (or [B, H_q, 1, D]) in q's dtype."""
    qg, p, ne, vis, key_exact, value_exact = _dense_reads(q, buf, pos, visible, now, n, scale)
    ring_s = lane_dot(qg[:, :, :, None, :], ring_rows(buf.k_ring, p)[:, :, None])  # [B, H, Gq, ne]
    s = torch.where(key_exact, ring_s, int_scores(qg, buf, ne)).masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    e_ring = torch.where(value_exact, torch.exp(s - m), 0.0)
    e = torch.where(value_exact, 0.0, vexp(s - m))
    l = e.double().sum(-1, keepdim=True) + e_ring.double().sum(-1, keepdim=True)
    out = int_values(e, buf, ne) + e_ring.double() @ ring_rows(buf.v_ring, p).double()
    return _finish(out, l, q)


def kivi_attention_int_triton_torch(q: Tensor, buf: KIVIBuffers, pos: Tensor, visible: Optional[Tensor],
                                    now: Tensor, n: int, scale: Optional[float] = None) -> Tensor:
    """The twin of the Triton kernel (kernels/kivi_int_triton.py; "Triton" in the module docstring), same
    contract as kivi_attention_int_torch; float64 wherever the kernel's result does not depend on its
    rounding."""
    qg, p, ne, vis, key_exact, value_exact = _dense_reads(q, buf, pos, visible, now, n, scale)
    B, H, Gq, D = qg.shape
    G = buf.group
    ng = ne // G
    S, a = key_dots(qg, buf, ne)
    u = S.float() * a                                                              # [B, H, Gq, ng, G] fp32
    z = (qg.double()[:, :, :, None] * buf.k_min[:, :, None, :ng].double()).sum(-1)  # [B, H, Gq, ng]
    ring_s = qg.double() @ ring_rows(buf.k_ring, p).double().transpose(-1, -2)      # [B, H, Gq, ne]
    s = torch.where(key_exact, ring_s, (u.double() + z[..., None]).view(B, H, Gq, ne)).masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    e_ring = torch.where(value_exact, torch.exp(s - m), 0.0)                       # [B, H, Gq, ne] float64
    packed = vis & ~value_exact
    packed = packed.view(*packed.shape[:2], 1, ng, G)
    mu = u.masked_fill(~packed, -math.inf).amax(-1, keepdim=True)                  # [B, H, Gq, ng, 1]
    some = ~torch.isinf(mu[..., 0])
    mu = torch.where(torch.isinf(mu), 0.0, mu)
    e = torch.where(packed, vexp(u - mu), 0.0)                                     # local weights, fp32
    factor = torch.where(some, torch.exp(mu[..., 0].double() + z - m), 0.0)        # [B, H, Gq, ng]
    vs = buf.v_scale[:, :, :ne].float().view(B, H, 1, ng, G, -1)
    pv = e[..., None] * vs                                                         # [B, H, Gq, ng, G, NCG]
    pmax = pv.amax(4, keepdim=True)
    pw = (pv * _inverse(pmax, WMAX)).round()
    cv = unpack(buf.v_packed[:, :, :ne], buf.bits, -1).view(B, H, ng, G, -1, G).double()
    sums = torch.einsum("bhqgtc,bhgtcj->bhqgcj", pw.double(), cv)                 # exact integers
    minimums = torch.einsum("bhqgt,bhgtc->bhqgc", e.double(), buf.v_min[:, :, :ne].double().view(B, H, ng, G, -1))
    block = sums * (pmax / WMAX)[:, :, :, :, 0, :, None].double() + minimums[..., None]
    out = (factor[..., None, None] * block).sum(3).flatten(-2)                     # [B, H, Gq, D]
    l = (factor * e.double().sum(-1)).sum(-1, keepdim=True) + e_ring.sum(-1, keepdim=True)
    return _finish(out + e_ring @ ring_rows(buf.v_ring, p).double(), l, q)
