"""Integer KIVI attention in Triton: dense reads of 2/4-bit storage with kernels/kivi_int.py's scheme
("Triton" there; twin kivi_attention_int_triton_torch), beside the fp32-arithmetic kernel of
kernels/kivi_triton.py, whose grid, splits and merge it shares.

    kivi_attention_int_triton(q, buf, pos, visible, now, n, scale=None, n_splits=None) -> out
        the dense contract of kernels.kivi_attention.kivi_attention (2- or 4-bit storage)
    use_int_triton() -> bool
        whether kivi_attention's Triton backend runs this kernel: KVC_KIVI_ARITH (kernels/backend.py)
        "auto" (the default) and "int" (or a CPU ISA, "avx2" / "vnni": an integer request) yes; "fp32"
        no (the fp32-arithmetic kernel).  On an H100 this kernel read B8/4096 4-bit storage 5.7x faster
        than the fp32-arithmetic one (docs/results.md, section 14)

Per block of G slots (one key group): qs = q * s_k quantized to int8 per row (a = max |qs| / 127),
S = qi . codes as an int8 x int8 -> int32 tl.dot, u = S * a, s = u + q . m_k; the weights of the
slots whose value is packed are vexp(u - max u) (kernels/kivi_int.py's polynomial, so that the
interpreter and the GPU round alike), times the value scales and quantized to uint8 per (row,
channel group) over the block; their dot with the codes is an fp16 dot, exact for these integers.
Launched with enable_fp_fusion=False: products and sums stay separately rounded where the twin
rounds them; 2 warps, no software pipelining and about 4 programs per SM (the fastest of warps 2/4/8 x
stages 1/3 x 1/2/4 programs per SM on an H100 at B8/4096: 80 us against 166 us for Triton's default 4
warps / 3 stages at 2 per SM; docs/results.md section 14).  Needs D, G powers of two, G >= 16, D >= 32
(int8 dots take K >= 32 on NVIDIA GPUs).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from .backend import kivi_arith_request
from .kivi_triton import block_rows, launch_operands, merged_output, partials, split_plan

triton = tl = None
rne = vexp = None                     # the kernel's jitted helpers (module globals: Triton resolves names there)
_use_int: Optional[bool] = None       # KVC_KIVI_ARITH as read for CUDA, once (use_int_triton)


def use_int_triton() -> bool:
    global _use_int
    if _use_int is None:
        _use_int = kivi_arith_request() != "fp32"
    return _use_int


def int_triton_supported(q: Tensor, buf) -> bool:
    D, G = q.shape[-1], buf.group
    return (buf.bits in (2, 4) and D >= 32 and not D & (D - 1) and G >= 16 and not G & (G - 1)
            and D % G == 0)


@lru_cache(maxsize=None)
def _kernel():
    global triton, tl, rne, vexp
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def _rne(x):
        """Round half to even (|x| < 2^22): the fp32 add aligns x to integers."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _vexp(x):
        """kernels/kivi_int.py's vexp (cpu_vec.h's polynomial), step by step."""
        under = x < -87.3
        x = tl.where(under, 0.0, tl.minimum(x, 88.3))
        t = tl.fma(x, 1.44269504088896341, 0.5)
        n = t.to(tl.int32)
        n = n - (n.to(tl.float32) > t).to(tl.int32)
        nf = n.to(tl.float32)
        x = tl.fma(-nf, 0.693359375, x)
        x = tl.fma(nf, 2.12194440e-4, x)
        y = tl.fma(x, 1.9875691500e-4, 1.3981999507e-3)
        y = tl.fma(y, x, 8.3334519073e-3)
        y = tl.fma(y, x, 4.1665795894e-2)
        y = tl.fma(y, x, 1.6666665459e-1)
        y = tl.fma(y, x, 5.0000001201e-1)
        y = tl.fma(y * x, x, x) + 1.0
        r = y * ((n + 127) << 23).to(tl.float32, bitcast=True)
        return tl.where(under, 0.0, r)

    rne, vexp = _rne, _vexp

    @triton.jit
    def kivi_int_partial(Q, KP, KS, KM, VP, VS, VM, KR, VR, POS, VIS, NOW,
                         M_PART, L_PART, ACC_PART, RING_PART,
                         scale, n_len, per_split, n_splits, rows, R,
                         sq_b, sq_h, skp_b, skp_h, skp_t, skp_w, sks_b, sks_h, sks_g,
                         svp_b, svp_h, svp_t, svp_w, svs_b, svs_h, svs_t, svs_c, skr_b, skr_h, skr_r,
                         spos_b, spos_h, svis_b, svis_h,
                         D: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                         NCG: tl.constexpr, BLOCK_G: tl.constexpr, HAS_VIS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2)
        og = tl.arange(0, BLOCK_G)
        od = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + (h * rows + og)[:, None] * sq_h + od[None, :], mask=(og < rows)[:, None],
                    other=0.0).to(tl.float32) * scale
        word, shift = od % W, ((od // W) * BITS).to(tl.int32)
        lvl = (1 << BITS) - 1
        oc, oj = tl.arange(0, NCG), tl.arange(0, GROUP)
        vd = oc[:, None] * GROUP + oj[None, :]                 # value channel d = c * G + j  [NCG, G]
        now = tl.load(NOW + b)
        nxt = now + 1
        kfrom = nxt - nxt % R
        kp, ks, km = KP + b * skp_b + h * skp_h, KS + b * sks_b + h * sks_h, KM + b * sks_b + h * sks_h
        vp, vs, vm = VP + b * svp_b + h * svp_h, VS + b * svs_b + h * svs_h, VM + b * svs_b + h * svs_h
        kr, vr = KR + b * skr_b + h * skr_h, VR + b * skr_b + h * skr_h
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([NCG, BLOCK_G, GROUP], dtype=tl.float32)
        racc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, n_len)
        for t0 in range(start, end, GROUP):
            slot = (t0 + tl.arange(0, GROUP)).to(tl.int64)
            ok = slot < end
            if HAS_VIS:
                ok = ok & (tl.load(VIS + b * svis_b + h * svis_h + slot, mask=ok, other=0) != 0)
            p = tl.load(POS + b * spos_b + h * spos_h + slot, mask=ok, other=-1)
            v_exact = ok & (p >= 0) & (p > now - R)
            k_exact = v_exact & (p >= kfrom)
            packed = ok & ~v_exact
            row = p % R
            # keys: int8 query x codes per group, zero point once
            g = t0 // GROUP
            qs = q * tl.load(ks + g * sks_g + od).to(tl.float32)[None, :]
            amax = tl.max(tl.abs(qs), 1)
            some_q = amax > 0
            inv = tl.where(some_q, tl.math.div_rn(tl.full([BLOCK_G], 127.0, tl.float32), tl.where(some_q, amax, 1.0)), 0.0)
            qi = rne(qs * inv[:, None]).to(tl.int8)
            kc = ((tl.load(kp + slot[:, None] * skp_t + word[None, :] * skp_w, mask=ok[:, None], other=0)
                   >> shift[None, :]) & lvl).to(tl.int8)                                  # [G, D]
            S = tl.dot(qi, tl.trans(kc), out_dtype=tl.int32)                              # [BLOCK_G, G]
            u = S.to(tl.float32) * tl.math.div_rn(amax, tl.full([BLOCK_G], 127.0, tl.float32))[:, None]
            z = tl.sum(q * tl.load(km + g * sks_g + od).to(tl.float32)[None, :], 1)
            k_r = tl.load(kr + row[:, None] * skr_r + od[None, :], mask=k_exact[:, None], other=0.0).to(tl.float32)
            s = tl.where(k_exact[None, :], tl.dot(q, tl.trans(k_r), input_precision="ieee"), u + z[:, None])
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            # values in the ring: fp32 weights
            pe = tl.where(v_exact[None, :], tl.exp(s - m_safe[:, None]), 0.0)
            v_r = tl.load(vr + row[:, None] * skr_r + od[None, :], mask=v_exact[:, None], other=0.0).to(tl.float32)
            racc = racc * alpha[:, None] + tl.dot(pe, v_r, input_precision="ieee")
            # packed values: block-local weights, x scales, uint8 per (row, channel group)
            mu = tl.max(tl.where(packed[None, :], u, float("-inf")), 1)
            some = mu > float("-inf")
            mu = tl.where(some, mu, 0.0)
            e = tl.where(packed[None, :], vexp(u - mu[:, None]), 0.0)                     # [BLOCK_G, G_t]
            factor = tl.where(some, tl.exp(mu + z - m_safe), 0.0)
            v_s = tl.load(vs + slot[None, :] * svs_t + oc[:, None] * svs_c, mask=ok[None, :], other=0.0).to(tl.float32)
            v_m = tl.load(vm + slot[None, :] * svs_t + oc[:, None] * svs_c, mask=ok[None, :], other=0.0).to(tl.float32)
            pv = e[None, :, :] * v_s[:, None, :]                                          # [NCG, BLOCK_G, G_t]
            pmax = tl.max(pv, 2)
            some_w = pmax > 0
            winv = tl.where(some_w, tl.math.div_rn(tl.full([NCG, BLOCK_G], 255.0, tl.float32), tl.where(some_w, pmax, 1.0)),
                            0.0)
            pw = rne(pv * winv[:, :, None]).to(tl.float16)
            vc = ((tl.load(vp + slot[None, :, None] * svp_t + (vd % W)[:, None, :] * svp_w, mask=ok[None, :, None],
                           other=0) >> ((vd // W) * BITS).to(tl.int32)[:, None, :]) & lvl).to(tl.float16)
            sums = tl.dot(pw, vc, out_dtype=tl.float32)                                   # [NCG, BLOCK_G, G]
            bscale = tl.math.div_rn(pmax, tl.full([NCG, BLOCK_G], 255.0, tl.float32))
            block = bscale[:, :, None] * sums + tl.sum(e[None, :, :] * v_m[:, None, :], 2)[:, :, None]
            acc = acc * alpha[None, :, None] + factor[None, :, None] * block
            l_i = l_i * alpha + tl.sum(pe, 1) + factor * tl.sum(e, 1)
            m_i = m_new
        base = (b * tl.num_programs(1) + h) * n_splits + sp
        tl.store(M_PART + base * BLOCK_G + og, m_i)
        tl.store(L_PART + base * BLOCK_G + og, l_i)
        tl.store(ACC_PART + base * NCG * BLOCK_G * GROUP + (oc[:, None, None] * BLOCK_G + og[None, :, None]) * GROUP
                 + oj[None, None, :], acc)
        tl.store(RING_PART + (base * BLOCK_G + og[:, None]) * D + od[None, :], racc)

    return kivi_int_partial


def kivi_attention_int_triton(q: Tensor, buf, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int,
                              scale: Optional[float] = None, n_splits: Optional[int] = None) -> Tensor:
    """Dense reads of slots [0, n) in the integer scheme (module docstring); n_splits as
    kernels.kivi_triton.kivi_attention_triton's."""
    q3 = q[:, :, 0] if q.dim() == 4 else q
    B, Hq, D = q3.shape
    H, G = buf.k_packed.shape[1], buf.group
    if not int_triton_supported(q3, buf):
        raise ValueError(f"the integer Triton KIVI kernel needs 2/4-bit storage, power-of-two head_dim >= 32 and "
                         f"group >= 16, got {buf.bits} bits, {D}, {G}")
    rows = Hq // H
    BLOCK_G = block_rows(rows)
    n_splits, per_split = split_plan(q, B * H, n, G, n_splits, per_sm=4)
    NCG = D // G
    parts = partials(q, B, H, n_splits, BLOCK_G, NCG, G, D)
    tensors, strides = launch_operands(q3, buf, pos, visible, now)
    _kernel()[(B, H, n_splits)](
        *tensors, *parts,
        float(1.0 / math.sqrt(D) if scale is None else scale), n, per_split, n_splits, rows, buf.residual,
        *strides,
        D=D, W=buf.k_packed.shape[-1], BITS=buf.bits, GROUP=G, NCG=NCG, BLOCK_G=BLOCK_G,
        HAS_VIS=visible is not None, enable_fp_fusion=False, num_warps=2, num_stages=1)
    return merged_output(q, parts, rows)
