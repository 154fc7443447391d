"""A KIVI decode write in one Triton launch (GPU; on CPU under TRITON_INTERPRET=1 for tests): the twin of
cache.quantized.SlotStore.write_torch, bit for bit (as kernels/kivi_kernels.cpp's kivi_write is on CPU).

    kivi_write_triton(buf, slot, k, v, pos, now, where=None)
        k, v [B, H, 1, D] into slot [B, H] of the store's buffers (pos [B, H or 1, S] already holds the
        slot's position, now [B]); where [B, H] bool: write only there.
    write_triton_supported(buf) -> bool

One program per (row, KV head), the codec of kernels/kivi_codec.py in fp32:
- keys: the slot's key group of G slots is dequantized, its slots among the newest R replaced by their
  exact ring rows and the slot itself by k, then requantized per channel over the slots that hold a
  position (min/max, scale rounded up to the storage dtype, codes rounded half to even) and repacked;
- the value: quantized per channel group of G on its own, packed;
- the ring: row pos % R takes k and v when the position is among the newest R.
The torch twin runs about 200 small ops a layer, each a launch with its host time on a GPU; with this
kernel (and the attention's merge in one launch) 4-bit decode on an H100 went from 0.37x to 0.72x of the
16-bit cache's speed (docs/results.md, section 14).  Codes live in the planar word layout: channel
d = j W + w is code j of word w, so a [G, P, W] tile is unpacked by one shift per plane and packed by an
OR over the planes.
Launched with enable_fp_fusion=False (every product and sum rounded as the twin rounds it).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from .kivi_codec import codes_per_word
from .kivi_triton import head_stride, row_major

triton = tl = None
_bitor = _rne = _stored = _scale_up = None   # the kernel's jitted helpers (module globals: Triton resolves names there)


@lru_cache(maxsize=None)
def _kernel():
    global triton, tl, _bitor, _rne, _stored, _scale_up
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def bitor(a, b):
        return a | b

    @triton.jit
    def rne(x):
        """Round half to even (|x| < 2^22): the fp32 add aligns x to integers."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def stored(x, DT: tl.constexpr):
        """fp32 x (finite) -> DT rounded to nearest even; bf16 by its bits (the interpreter's cast truncates)."""
        if DT == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DT)

    @triton.jit
    def scale_up(lo, hi, LVL: tl.constexpr, DT: tl.constexpr, UT: tl.constexpr):
        """kivi_codec._scale_min: (hi - lo) / LVL in dtype DT, one step up where rounding went down
        (UT: the unsigned integer type as wide as DT, for nextafter of a non-negative float)."""
        span = hi - lo
        s = _stored(tl.math.div_rn(span, tl.full(span.shape, LVL, tl.float32)), DT)
        short = s.to(tl.float32) * LVL < span
        return tl.where(short, (s.to(UT, bitcast=True) + 1).to(DT, bitcast=True), s)

    _bitor, _rne, _stored, _scale_up = bitor, rne, stored, scale_up

    @triton.jit
    def kivi_write(KP, KS, KM, VP, VS, VM, KR, VR, SLOT, K, V, POS, NOW, WHERE, S, R,
                   skp_b, skp_h, skp_t, skp_w, sks_b, sks_h, sks_g, svp_b, svp_h, svp_t, svp_w,
                   svs_b, svs_h, svs_t, svs_c, skr_b, skr_h, skr_r, spos_b, spos_h,
                   D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   NCG: tl.constexpr, DT: tl.constexpr, UT: tl.constexpr, HAS_WHERE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        bh = b * tl.num_programs(1) + h
        LVL: tl.constexpr = (1 << BITS) - 1
        ot, oj, ow = tl.arange(0, GROUP), tl.arange(0, P), tl.arange(0, W)
        d = oj[:, None] * W + ow[None, :]                                          # channel of [P, W]
        vshift = (oj * BITS).to(tl.int32)[:, None]                                 # [P, 1]
        shift = vshift[None]                                                       # [1, P, 1]
        one = tl.zeros([1], dtype=tl.int64)       # masks come from [1] loads (the interpreter takes no scalar mask)
        now = tl.load(NOW + b)
        slot = tl.load(SLOT + bh)
        wr = tl.load(SLOT + bh + one) >= 0                                         # [1]: always, unless where
        if HAS_WHERE:
            wr = tl.load(WHERE + bh + one) != 0
        g = slot // GROUP
        idx = g * GROUP + ot                                                       # the key group's slots
        posr = POS + b * spos_b + h * spos_h
        pm = tl.load(posr + idx, mask=idx < S, other=-1)
        me = idx == slot
        young = (pm >= 0) & (pm > now - R)
        kk = tl.load(K + bh * D + d).to(tl.float32)                                # [P, W]
        vv = tl.load(V + bh * D + d).to(tl.float32)
        # keys: dequantize the group, exact rows where held, requantize
        kp, kr = KP + b * skp_b + h * skp_h, KR + b * skr_b + h * skr_h
        ks, km = KS + b * sks_b + h * sks_h + g * sks_g, KM + b * sks_b + h * sks_h + g * sks_g
        words = tl.load(kp + idx[:, None] * skp_t + ow[None, :] * skp_w)           # [G, W]
        codes = (words[:, None, :] >> shift) & LVL                                 # [G, P, W]
        x = codes.to(tl.float32) * tl.load(ks + d).to(tl.float32)[None] + tl.load(km + d).to(tl.float32)[None]
        ring = tl.load(kr + (pm % R)[:, None, None] * skr_r + d[None], mask=young[:, None, None], other=0.0)
        x = tl.where(young[:, None, None], ring.to(tl.float32), x)
        x = tl.where(me[:, None, None], kk[None], x)
        inc = ((pm >= 0) | me)[:, None, None]
        some = tl.max(inc.to(tl.int32), 0) > 0                                    # [P, W]
        lo = tl.where(some, tl.min(tl.where(inc, x, float("inf")), 0), 0.0)
        hi = tl.where(some, tl.max(tl.where(inc, x, float("-inf")), 0), 0.0)
        scale, mn = _scale_up(lo, hi, LVL, DT, UT), _stored(lo, DT)
        sf = scale.to(tl.float32)
        safe = tl.where(sf > 0, sf, 1.0)
        q = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x - mn.to(tl.float32)[None], safe[None])), 0.0), LVL)
        q = tl.where(inc, q.to(tl.int32), 0)
        tl.store(kp + idx[:, None] * skp_t + ow[None, :] * skp_w, tl.reduce(q << shift, 1, _bitor), mask=wr[:, None])
        tl.store(ks + d, scale, mask=wr[:, None])
        tl.store(km + d, mn, mask=wr[:, None])
        # the value: per channel group of G, on its own
        cg = d // GROUP
        vlo = tl.zeros([P, W], dtype=tl.float32)
        vhi = tl.zeros([P, W], dtype=tl.float32)
        for c in tl.static_range(NCG):
            vlo = tl.where(cg == c, tl.min(tl.where(cg == c, vv, float("inf"))), vlo)
            vhi = tl.where(cg == c, tl.max(tl.where(cg == c, vv, float("-inf"))), vhi)
        vscale, vmn = _scale_up(vlo, vhi, LVL, DT, UT), _stored(vlo, DT)
        vsf = vscale.to(tl.float32)
        vsafe = tl.where(vsf > 0, vsf, 1.0)
        vq = tl.minimum(tl.maximum(_rne(tl.math.div_rn(vv - vmn.to(tl.float32), vsafe)), 0.0), LVL).to(tl.int32)
        vp = VP + b * svp_b + h * svp_h + slot * svp_t
        tl.store(vp + ow * svp_w, tl.reduce(vq << vshift, 0, _bitor), mask=wr)
        first = (d % GROUP) == 0                                                   # one store per group
        vs_at = b * svs_b + h * svs_h + slot * svs_t + cg * svs_c
        tl.store(VS + vs_at, vscale, mask=first & wr[:, None])
        tl.store(VM + vs_at, vmn, mask=first & wr[:, None])
        # the ring
        p_slot = tl.load(posr + slot + one, mask=slot + one < S, other=-1)        # [1]
        ring_ok = (wr & (p_slot >= 0) & (p_slot > now - R))[:, None]
        at = (p_slot % R)[:, None] * skr_r + d
        tl.store(kr + at, _stored(kk, DT), mask=ring_ok)
        tl.store(VR + b * skr_b + h * skr_h + at, _stored(vv, DT), mask=ring_ok)

    return kivi_write


_TYPES = {torch.float32: ("float32", "uint32"), torch.bfloat16: ("bfloat16", "uint16"),
          torch.float16: ("float16", "uint16")}    # storage dtype -> (its Triton type, the unsigned one as wide)


def write_triton_supported(buf) -> bool:
    """Whether kivi_write_triton takes these buffers: power-of-two head_dim and group >= 16, fp32 / bf16 /
    fp16 storage with row-major scales and rings (SlotStore's layout)."""
    D, G = buf.k_ring.shape[-1], buf.group
    return (buf.k_scale.dtype in _TYPES and not D & (D - 1) and not G & (G - 1) and G >= 16
            and buf.k_ring.stride(-1) == 1 and buf.k_scale.stride(-1) == 1)


def kivi_write_triton(buf, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, now: Tensor,
                      where: Optional[Tensor] = None) -> None:
    """cache.quantized.SlotStore.write_torch in one launch (module docstring); buf: the store's buffers."""
    B, H, _, D = k.shape
    if not write_triton_supported(buf):
        raise ValueError(f"kivi_write_triton needs power-of-two head_dim and group >= 16 and fp32/bf16/fp16 "
                         f"storage, got {D}, {buf.group}, {buf.k_scale.dtype}")
    G, P = buf.group, codes_per_word(buf.bits)
    kp, ks, vp, vs, kr = buf.k_packed, buf.k_scale, buf.v_packed, buf.v_scale, buf.k_ring
    slot, posc = slot.long().contiguous(), row_major(pos)
    kernel = _kernel()
    dt, ut = (getattr(tl, name) for name in _TYPES[ks.dtype])
    kernel[(B, H)](
        kp, ks, buf.k_min, vp, vs, buf.v_min, kr, buf.v_ring, slot, k.reshape(B, H, D).contiguous(),
        v.reshape(B, H, D).contiguous(), posc, now.contiguous(),
        slot if where is None else where.contiguous(),                 # (slot: a placeholder, never read)
        posc.shape[2], kr.shape[2], *kp.stride(), *ks.stride()[:3], *vp.stride(), *vs.stride(), *kr.stride()[:3],
        posc.stride(0), head_stride(posc),
        D=D, W=D // P, P=P, BITS=buf.bits, GROUP=G, NCG=D // G, DT=dt, UT=ut,
        HAS_WHERE=where is not None, enable_fp_fusion=False, num_warps=1)
