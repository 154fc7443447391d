"""The Triton kernel of kernels.kivi_attention (GPU; on CPU under TRITON_INTERPRET=1 for tests).

Grid (B, H_idx, n_splits); a program takes the query rows reading one list (dense: the G_q query heads
of a KV head; sparse: one index list, shared by G_q rows or owned by one), padded to BLOCK_G >= 16 rows
for tl.dot, over a range of slots, and keeps an fp32 online softmax.  Per block of BLOCK_T = G slots:
- keys, dense: one key group per block, so its scale folds into the query (qs = q * s_k, one row of
  scales) and its minimum into one dot product (z = q . m_k): s = qs . codes^T + z.  Sparse: the
  selected slots belong to different groups: codes * s_k + m_k per slot, in registers.
- values: per token, so scale and minimum go into the softmax weights, per channel group c (a batched
  dot over the D / G groups): out_c += (p * s_v[:, c]) . codes_c, z_c += p . m_v[:, c].
- the residual: slots whose key / value is exact (`ring_flags`) load ring rows (masked loads) and
  replace the packed scores / go into a separate P . V_ring accumulator.
The splits' partials are merged by log-sum-exp in one more launch (kivi_merge; twin `_merge`), not a
chain of torch ops: on an H100 those cost more host time than the kernel took (docs/results.md, section
14).  Needs G >= 16 and D, G powers of two.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

triton = tl = None


@lru_cache(maxsize=None)
def _kernel():
    global triton, tl
    import triton as _triton
    import triton.language as _tl
    triton, tl = _triton, _tl

    @triton.jit
    def kivi_partial(Q, KP, KS, KM, VP, VS, VM, KR, VR, POS, VIS, NOW, IDX, VALID,
                     M_PART, L_PART, ACC_PART, RING_PART,
                     scale, n_len, per_split, n_splits, rows, Gq, R,
                     sq_b, sq_h, skp_b, skp_h, skp_t, skp_w, sks_b, sks_h, sks_g,
                     svp_b, svp_h, svp_t, svp_w, svs_b, svs_h, svs_t, svs_c, skr_b, skr_h, skr_r,
                     spos_b, spos_h, svis_b, svis_h, sidx_b, sidx_h,
                     D: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     NCG: tl.constexpr, BLOCK_G: tl.constexpr, SPARSE: tl.constexpr, HAS_VIS: tl.constexpr,
                     HAS_VALID: tl.constexpr, PER_QUERY: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        hi = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2)
        h = hi // Gq if PER_QUERY else hi                     # KV head
        q0 = hi if PER_QUERY else hi * Gq                     # first query row
        og = tl.arange(0, BLOCK_G)
        gmask = og < rows
        od = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + (q0 + og)[:, None] * sq_h + od[None, :], mask=gmask[:, None],
                    other=0.0).to(tl.float32) * scale
        word, shift = od % W, ((od // W) * BITS).to(tl.int32)
        lvl = (1 << BITS) - 1
        oc, oj = tl.arange(0, NCG), tl.arange(0, GROUP)       # value channel d = c * G + j
        vd = oc[:, None] * GROUP + oj[None, :]                 # [NCG, G]
        now = tl.load(NOW + b)
        nxt = now + 1
        kfrom = nxt - nxt % R
        kp, ks, km = KP + b * skp_b + h * skp_h, KS + b * sks_b + h * sks_h, KM + b * sks_b + h * sks_h
        vp, vs, vm = VP + b * svp_b + h * svp_h, VS + b * svs_b + h * svs_h, VM + b * svs_b + h * svs_h
        kr, vr = KR + b * skr_b + h * skr_h, VR + b * skr_b + h * skr_h
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([NCG, BLOCK_G, GROUP], dtype=tl.float32)
        zacc = tl.zeros([NCG, BLOCK_G], dtype=tl.float32)
        racc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, n_len)
        for t0 in range(start, end, GROUP):
            ot = t0 + tl.arange(0, GROUP)
            ok = ot < end
            if SPARSE:
                slot = tl.load(IDX + b * sidx_b + hi * sidx_h + ot, mask=ok, other=0)
                if HAS_VALID:
                    ok = ok & (tl.load(VALID + b * sidx_b + hi * sidx_h + ot, mask=ok, other=0) != 0)
            else:
                slot = ot.to(tl.int64)
            if HAS_VIS:                                       # dense slots and selected ones alike
                ok = ok & (tl.load(VIS + b * svis_b + h * svis_h + slot, mask=ok, other=0) != 0)
            p = tl.load(POS + b * spos_b + h * spos_h + slot, mask=ok, other=-1)
            v_exact = ok & (p >= 0) & (p > now - R)
            k_exact = v_exact & (p >= kfrom)
            row = p % R
            m2 = ok[:, None]
            kc = ((tl.load(kp + slot[:, None] * skp_t + word[None, :] * skp_w, mask=m2, other=0) >> shift[None, :])
                  & lvl).to(tl.float32)                                           # [G, D]
            if SPARSE:                                        # selected slots of different groups
                grp = slot // GROUP
                k_s = tl.load(ks + grp[:, None] * sks_g + od[None, :], mask=m2, other=0.0).to(tl.float32)
                k_m = tl.load(km + grp[:, None] * sks_g + od[None, :], mask=m2, other=0.0).to(tl.float32)
                s = tl.dot(q, tl.trans(kc * k_s + k_m), input_precision="ieee")
            else:                                             # one group: fold its scale and minimum
                k_s = tl.load(ks + (t0 // GROUP) * sks_g + od).to(tl.float32)
                k_m = tl.load(km + (t0 // GROUP) * sks_g + od).to(tl.float32)
                s = tl.dot(q * k_s[None, :], tl.trans(kc), input_precision="ieee") + tl.sum(q * k_m[None, :], 1)[:, None]
            k_r = tl.load(kr + row[:, None] * skr_r + od[None, :], mask=k_exact[:, None], other=0.0).to(tl.float32)
            s = tl.where(k_exact[None, :], tl.dot(q, tl.trans(k_r), input_precision="ieee"), s)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pe = tl.exp(s - m_safe[:, None])                                          # [BLOCK_G, G]
            l_i = l_i * alpha + tl.sum(pe, 1)
            # values: ring rows for the newest R, the packed rest with scale/min on the weights
            v_r = tl.load(vr + row[:, None] * skr_r + od[None, :], mask=v_exact[:, None], other=0.0).to(tl.float32)
            racc = racc * alpha[:, None] + tl.dot(tl.where(v_exact[None, :], pe, 0.0), v_r, input_precision="ieee")
            pp = tl.where(v_exact[None, :], 0.0, pe)
            v_s = tl.load(vs + slot[None, :] * svs_t + oc[:, None] * svs_c, mask=ok[None, :], other=0.0).to(tl.float32)
            v_m = tl.load(vm + slot[None, :] * svs_t + oc[:, None] * svs_c, mask=ok[None, :], other=0.0).to(tl.float32)
            vc = ((tl.load(vp + slot[None, :, None] * svp_t + (vd % W)[:, None, :] * svp_w, mask=ok[None, :, None],
                           other=0) >> ((vd // W) * BITS).to(tl.int32)[:, None, :]) & lvl).to(tl.float32)   # [NCG, G_t, G]
            pw = pp[None, :, :] * v_s[:, None, :]                                      # [NCG, BLOCK_G, G_t]
            acc = acc * alpha[None, :, None] + tl.dot(pw, vc, input_precision="ieee")
            zacc = zacc * alpha[None, :] + tl.sum(pp[None, :, :] * v_m[:, None, :], 2)
            m_i = m_new
        base = (b * tl.num_programs(1) + hi) * n_splits + sp
        tl.store(M_PART + base * BLOCK_G + og, m_i)
        tl.store(L_PART + base * BLOCK_G + og, l_i)
        acc = acc + zacc[:, :, None]
        tl.store(ACC_PART + base * NCG * BLOCK_G * GROUP + (oc[:, None, None] * BLOCK_G + og[None, :, None]) * GROUP
                 + oj[None, None, :], acc)
        tl.store(RING_PART + (base * BLOCK_G + og[:, None]) * D + od[None, :], racc)

    return kivi_partial


def triton_supported(q: Tensor, buf) -> bool:
    D, G = q.shape[-1], buf.group
    return D >= 16 and not D & (D - 1) and G >= 16 and not G & (G - 1) and D % G == 0


def kivi_attention_triton(q: Tensor, buf, pos: Tensor, visible: Optional[Tensor], now: Tensor, n: int,
                          scale: Optional[float] = None, idx: Optional[Tensor] = None,
                          valid: Optional[Tensor] = None, n_splits: Optional[int] = None) -> Tensor:
    """Contract of kernels.kivi_attention.kivi_attention; n_splits: programs per list (default: about
    two per SM on CUDA, 1 elsewhere)."""
    q3 = q[:, :, 0] if q.dim() == 4 else q
    B, Hq, D = q3.shape
    H, G, R = buf.k_packed.shape[1], buf.group, buf.residual
    if not triton_supported(q3, buf):
        raise ValueError(f"the Triton KIVI kernel needs power-of-two head_dim and group >= 16, got {D}, {G}")
    Gq, sparse = Hq // H, idx is not None
    Hidx = idx.shape[1] if sparse else H
    per_query = sparse and Hidx == Hq and Gq > 1
    rows = 1 if per_query else Gq
    length = idx.shape[2] if sparse else n
    BLOCK_G = block_rows(rows)
    n_splits, per_split = split_plan(q, B * Hidx, length, G, n_splits)
    NCG = D // G
    parts = partials(q, B, Hidx, n_splits, BLOCK_G, NCG, G, D)
    tensors, strides = launch_operands(q3, buf, pos, visible, now)
    posc = tensors[9]                           # pos (long): idx and valid of dense reads, never read
    idxc = idx.long().contiguous() if sparse else posc
    val = valid.contiguous().view(torch.uint8) if valid is not None else idxc
    _kernel()[(B, Hidx, n_splits)](
        *tensors, idxc, val, *parts,
        float(1.0 / math.sqrt(D) if scale is None else scale), length, per_split, n_splits, rows, Gq, R,
        *strides, idxc.stride(0), idxc.stride(1),
        D=D, W=buf.k_packed.shape[-1], BITS=buf.bits, GROUP=G, NCG=NCG, BLOCK_G=BLOCK_G, SPARSE=sparse,
        HAS_VIS=visible is not None, HAS_VALID=valid is not None, PER_QUERY=per_query)
    return merged_output(q, parts, rows)


def launch_operands(q3: Tensor, buf, pos: Tensor, visible: Optional[Tensor], now: Tensor):
    """What both KIVI kernels (this one and kernels/kivi_int_triton.py's) take first: (q, the eight
    buffers, pos, visible (bytes; pos's first column when None), now) and the strides that follow the
    scalars (q's, the buffers', pos's and visible's; a dim of size 1 shared: stride 0)."""
    qc, posc, vis = q3.contiguous(), row_major(pos), row_major(visible)
    vis = vis.view(torch.uint8) if visible is not None else posc[:, :, :1]
    kp, ks, vp, vs, kr = buf.k_packed, buf.k_scale, buf.v_packed, buf.v_scale, buf.k_ring
    tensors = (qc, kp, ks, buf.k_min, vp, vs, buf.v_min, kr, buf.v_ring, posc, vis, now.contiguous())
    strides = (qc.stride(0), qc.stride(1), *kp.stride(), *ks.stride()[:3], *vp.stride(), *vs.stride(),
               *kr.stride()[:3], posc.stride(0), head_stride(posc), vis.stride(0), head_stride(vis))
    return tensors, strides


def merged_output(q: Tensor, parts: tuple[Tensor, ...], rows: int) -> Tensor:
    """The splits' partials (`partials`) merged into out [B, H_q, D] (or q's [B, H_q, 1, D]) in q's dtype,
    by kivi_merge (twin: `_merge`)."""
    m_part, l_part, acc_part, ring_part = parts
    B, Hi, S, NCG, BLOCK_G, G = acc_part.shape
    out = torch.empty(B, Hi * rows, q.shape[-1], device=q.device, dtype=q.dtype)
    _merge_kernel()[(B * Hi,)](m_part, l_part, acc_part, ring_part, out, S, rows,
                               D=q.shape[-1], GROUP=G, NCG=NCG, BLOCK_G=BLOCK_G)
    return out.unsqueeze(2) if q.dim() == 4 else out


@lru_cache(maxsize=None)
def _merge_kernel():
    _kernel()                                   # imports triton into the module globals

    @triton.jit
    def kivi_merge(M_PART, L_PART, ACC_PART, RING_PART, OUT, n_splits, rows,
                   D: tl.constexpr, GROUP: tl.constexpr, NCG: tl.constexpr, BLOCK_G: tl.constexpr):
        """One program per (b, list): _merge's log-sum-exp over the splits, rows < `rows` stored."""
        bh = tl.program_id(0).to(tl.int64)
        og, od = tl.arange(0, BLOCK_G), tl.arange(0, D)
        mx = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for sp in range(n_splits):
            mx = tl.maximum(mx, tl.load(M_PART + (bh * n_splits + sp) * BLOCK_G + og))
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.zeros([BLOCK_G], dtype=tl.float32)
        out = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        acc_at = ((od // GROUP)[None, :] * BLOCK_G + og[:, None]) * GROUP + (od % GROUP)[None, :]   # [BLOCK_G, D]
        for sp in range(n_splits):
            base = bh * n_splits + sp
            w = tl.exp(tl.load(M_PART + base * BLOCK_G + og) - mx)
            total += w * tl.load(L_PART + base * BLOCK_G + og)
            full = (tl.load(ACC_PART + base * NCG * BLOCK_G * GROUP + acc_at)
                    + tl.load(RING_PART + (base * BLOCK_G + og[:, None]) * D + od[None, :]))
            out += w[:, None] * full
        out = out / tl.maximum(total, 1.1754943508222875e-38)[:, None]
        tl.store(OUT + (bh * rows + og[:, None]) * D + od[None, :], out, mask=(og < rows)[:, None])

    return kivi_merge


def block_rows(rows: int) -> int:
    """BLOCK_G: the query rows a program takes, padded to a power of two >= 16 (tl.dot's minimum)."""
    return max(16, 1 << (rows - 1).bit_length())


def split_plan(q: Tensor, lists: int, length: int, G: int, n_splits: Optional[int],
               per_sm: int = 2) -> tuple[int, int]:
    """(n_splits, per_split slots) for `lists` programs' reads of `length` slots in blocks of G: n_splits
    None takes about `per_sm` programs per SM on CUDA (1 elsewhere); every split gets whole blocks, none is
    empty."""
    n_blocks = -(-length // G)
    if n_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 0
        n_splits = -(-per_sm * sms // lists) if sms else 1
    n_splits = max(1, min(int(n_splits), n_blocks))
    per_split = -(-n_blocks // n_splits) * G
    return max(1, -(-length // per_split)), per_split


def partials(q: Tensor, B: int, Hi: int, S: int, BLOCK_G: int, NCG: int, G: int, D: int) -> tuple[Tensor, ...]:
    """The splits' outputs (m, l [B, Hi, S, BLOCK_G]; acc [B, Hi, S, NCG, BLOCK_G, G]; ring [B, Hi, S,
    BLOCK_G, D]), fp32 on q's device, for _merge."""
    f32 = {"device": q.device, "dtype": torch.float32}
    return (torch.empty(B, Hi, S, BLOCK_G, **f32), torch.empty(B, Hi, S, BLOCK_G, **f32),
            torch.empty(B, Hi, S, NCG, BLOCK_G, G, **f32), torch.empty(B, Hi, S, BLOCK_G, D, **f32))


def row_major(t: Optional[Tensor]) -> Optional[Tensor]:
    """t with a unit stride along its last dim (a copy only where it has none)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def head_stride(t: Tensor) -> int:
    """t's stride along dim 1, 0 when that dim is 1 (shared by the KV heads)."""
    return t.stride(1) if t.shape[1] > 1 else 0


def _merge(m: Tensor, l: Tensor, acc: Tensor, ring: Tensor) -> Tensor:
    """kivi_merge's twin: splits' partials (m, l [B, Hi, S, r]; acc [B, Hi, S, NCG, r, G]; ring [B, Hi, S, r,
    D]) -> [B, Hi, r, D]."""
    B, Hi, S, NCG, r, G = acc.shape
    full = acc.permute(0, 1, 2, 4, 3, 5).reshape(B, Hi, S, r, NCG * G) + ring
    mx = m.amax(2, keepdim=True)
    w = torch.exp(m - torch.where(torch.isinf(mx), 0.0, mx))
    total = (w * l).sum(2)
    return (w[..., None] * full).sum(2) / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
