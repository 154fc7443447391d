"""KIVI storage for every storage policy (`--kv-bits 4|2`): the policy decides *which* tokens are
kept, this module decides *how* they are stored.

    with_kv_bits(policy, bits, group=32, residual=128)  the policy with KIVI-packed slots (16: as is)
    check_format(head_dim, bits, group, residual)        ValueError with a clear message when it cannot work

Storage by composition: every `EvictionPolicy` (streaming, h2o, snapkv, pyramidkv, d2o, tova, simlayerkv)
holds its K/V format as an object, `policy.slots`: cache/base.py's `DenseSlots` (compute dtype) by
default; `with_kv_bits` puts a `KIVISlots` (one `SlotStore` per layer, the same methods) there instead,
on the same policy object.  The plain `full` cache becomes `KIVIDenseCache`, an ordinary subclass of
cache.full.FullCache.  Selection (what to keep, which slot to evict) is the policy's own code, unchanged; kept
prompt tokens are selected (and D2O-merged) in full precision, then packed.  The sparse readers read
packed storage ("Sparse readers" below); POD is refused with a clear error.

Layout (`SlotStore`, one layer; B rows, H KV heads, C slots rounded up to a multiple of G, D = head_dim,
P = 32 // bits codes per int32 word, W = D // P; kernels/kivi_codec.py's formats, token-contiguous):
    k_packed [B, H, C, W] int32, k_scale / k_min [B, H, C // G, D]   keys per channel over the G slots
                                                                   of a slot group (slots gG .. gG+G-1)
    v_packed [B, H, C, W] int32, v_scale / v_min [B, H, C, D // G]   values per token over G channels
    k_ring, v_ring [B, H, R, D] (compute dtype)                      the residual: full precision
The policy's slot table `pos` ([B, H, S] per head, or [B, S] shared for `full`; S <= C) says which
position each slot holds.  The residual follows KIVI (kernels.kivi_attention.ring_flags; now = the
current query's position, n = now + 1 tokens seen): a slot's *value* is read from ring row pos % R
while its position is among the newest R (pos > now - R: a FIFO of R values); its *key* only while
its position is in the R-block still filling (pos >= n - n mod R: keys are quantized block-wise, R at
a time, so the n mod R newest are exact and the block becomes packed when it completes).  The key
rule selects a subset of the ring (ring row pos % R holds the exact key and value of each of the
newest R).  Every other slot is read from the packed words.  No per-slot flag and no flush step:
membership follows from the positions, and every store writes the packed copy too (write-through),
so a block that completes, or a token that ages out, needs nothing.  Under eviction the rule is the
same by position (the kept tokens among the current block's positions are exact), so a slot-addressed
cache keeps every guarantee below.  With left padding a slot group can straddle a position block:
its flushed members are read from codes that are re-quantized (from exact ring values) while the
group's later members arrive, so they may change once more until the group is full (padded rows only).

Writes (every one requantizes exactly the key groups it touches, from the best values at hand):
- a slot write (decode store, D2O merge target): the slot's key group [gG, gG+G) is re-coded from
  its members' values: the new key for the written slot, the ring (exact) for young members, the
  dequantized codes for old ones; the group's min/max are taken over the members holding a token
  (empty slots are don't-care, coded 0).  The value is quantized on its own (per token).  A young slot's ring
  row is written too.  So overwriting/evicting a packed token = dequantize its group, replace the
  row, requantize (tested against exactly that reference), and appending layers, whose groups fill
  one slot per step with all earlier members still in the ring (G <= R), end each group with the codes
  of one block quantization of exact keys, as KIVI's block-wise flush: old keys are never re-rounded
  there.  "Young" below = among the newest R (exact in the ring).  On fp32 CPU storage the writes run
  in C++ (kvc::kivi_write / kivi_write_range), a decode write on CUDA in one Triton launch
  (kernels/kivi_write_triton.py), both bit for bit with the torch code here.  Evicting layers re-round a
  group's old members when a new member changes its min/max
  (the price of per-channel keys under arbitrary slot overwrites; nothing drifts otherwise).
- prefill: the kept tokens (selected and merged in full precision) are block-quantized by slot
  group in one call; the young ones also go to the ring.  `full` takes the prompt in chunks: a
  later chunk attends the stored slots through a dequantized copy (prefill only).
Decode reads (sync-free, fixed shapes, one compiled graph for every step):
- attention: one op over the packed words and the residual (kernels.kivi_attention: the C++ op
  kvc::kivi_attention on CPU, in integer arithmetic where the CPU has AVX-512 VNNI (kernels/kivi_int.py;
  KVC_KIVI_ARITH chooses: kernels/cpu.py kivi_arith_default), Triton on CUDA, a torch twin elsewhere; no dequantized copy);
- H2O/D2O need the step's probabilities per slot: packed scores (`kivi_scores`) with the residual
  keys' scores taken from the ring, one joint softmax with the new token, then the weighted sum of
  packed values + ring rows (`kivi_values`);
- D2O's cosine similarity: packed scores with the evicted key as the query, over key norms
  dequantized block by block.
Memory (`kv_bytes`): packed words, scales, minimums and the ring, from the buffers; slot tables
(`pos`) are not counted, as for 16-bit storage.  At 4 bits, G = 32, D = 64 a slot costs 80 bytes in
bf16 (32 + 32 packed, 8 + 8 of scales/minimums) against 256, plus the ring's fixed 2 R D dtype bytes
per (row, head, layer), and for `full` one spare slot group (reads cover whole groups of the live
length, which must never reach the buffers' end: compiled graphs would change there): with R = 32,
under 1/3 once a layer holds more than ~2000 slots (`full` at 4000 tokens: 32.3%; snapkv 2048:
32.8%); at a 256-token budget the ring alone is 12.5% of the 16-bit size (streaming 256: 44%); the
default R = 128 adds 3 x 2 x 128 x D dtype bytes per (row, layer) (`full` at 4000 tokens: 34.6%).

Sparse readers (HShare, DS, Quest, alone or as STORAGE+READER) over packed storage: `with_kv_bits`
packs the reader's storage policy, and the reader goes through `kv_store(layer) -> (store, pos, now)`
(cache/sparse_read.py, `InnerStorage`): attention over the N selected slots is the same op as the
storage's own (kernels.kivi_attention with idx: each selected row dequantized in registers with its
own group's scale/minimum, residual ones from the ring), so it needs no dequantized cache; on the CPU the
readers have each store keep a slot-major copy of its packed words (`keep_slot_major`, read through
`reader_buffers`: one contiguous read per selected slot; every write refreshes it);
`store.gather(idx, pos, now)` returns the full-precision K/V of selected slots (Quest's page updates);
`store.dequantized(pos, now, n)` builds the label cache / page bounds once after prefill; the new
token's key arrives unquantized in decode (labels and page bounds update from it / from `gather`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from cache.scoring import NEVER, joint_softmax
from cache.sparse_read import InnerStorage
from kernels.kivi_attention import (KIVIBuffers, kivi_attention, kivi_gather, kivi_scores, kivi_values,
                                    ring_flags, ring_rows, whole_groups)
from kernels.cpu import (cpu_kernels_available, kivi_arith_default, kivi_write_cpu, kivi_write_range_cpu,
                         use_cpu_kernel)
from kernels.backend import resolve_backend
from kernels.kivi_codec import (QuantizedTensor, codes_per_word, dequantize_keys, dequantize_values, quantize_keys,
                                quantize_values)
from kernels.kivi_write_triton import kivi_write_triton, write_triton_supported
from cache.full import FullCache
from model import grouped_attention

BITS = (2, 4, 8)
GROUP, RESIDUAL = 32, 128      # KIVI's main setting: G = 32, R = 128
CHUNK = 512     # slots per block where packed keys are dequantized block by block (key norms)


def check_format(head_dim: Optional[int], bits: int, group: int, residual: int) -> None:
    """Raise ValueError (a one-line message naming the flag) unless the format can store head_dim."""
    if bits not in BITS:
        raise ValueError(f"--kv-bits {bits}: use 16 (the compute dtype), 4 or 2 (8 from Python)")
    if group < 1:
        raise ValueError(f"--kv-group-size must be positive, got {group}")
    if residual < group or residual % group:
        raise ValueError(f"--kv-residual {residual} must be a positive multiple of --kv-group-size {group}")
    if head_dim is not None:
        if head_dim % group:
            raise ValueError(f"--kv-bits {bits}: head_dim {head_dim} is not a multiple of --kv-group-size "
                             f"{group} (values are quantized per token over groups of G channels)")
        if head_dim % codes_per_word(bits):
            raise ValueError(f"--kv-bits {bits}: head_dim {head_dim} is not a multiple of "
                             f"{codes_per_word(bits)} ({bits}-bit codes per int32 word)")


# ------------------------------------------------------------------------------------ one layer
class SlotStore:
    """One layer's KIVI-packed slots plus the full-precision ring (layout and rules: module docstring).

    Every method takes the policy's slot table `pos` [B, H or 1, S] (S <= C slots; -1 = empty) and
    `now` [B] (the current query position); nothing syncs with the host, shapes never depend on data.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, slots: int, bits: int = 4, group: int = 32,
                 residual: int = RESIDUAL, dtype: torch.dtype = torch.float32, device=None, backend: str = "auto"):
        check_format(head_dim, bits, group, residual)
        B, H, D, G, R = batch, heads, head_dim, group, residual
        W, C = D // codes_per_word(bits), -(-max(slots, 1) // G) * G
        self.bits, self.group, self.residual, self.dtype, self.backend = bits, G, R, dtype, backend
        self.heads, self.head_dim = H, D
        z = {"device": device}
        self.k_packed = torch.zeros(B, H, W, C, dtype=torch.int32, **z).transpose(-1, -2)
        self.k_scale = torch.zeros(B, H, C // G, D, dtype=dtype, **z)
        self.k_min = torch.zeros(B, H, C // G, D, dtype=dtype, **z)
        self.v_packed = torch.zeros(B, H, W, C, dtype=torch.int32, **z).transpose(-1, -2)
        self.v_scale = torch.zeros(B, H, D // G, C, dtype=dtype, **z).transpose(-1, -2)
        self.v_min = torch.zeros(B, H, D // G, C, dtype=dtype, **z).transpose(-1, -2)
        self.k_ring = torch.zeros(B, H, R, D, dtype=dtype, **z)
        self.v_ring = torch.zeros(B, H, R, D, dtype=dtype, **z)
        self.slot_words: Optional[tuple[Tensor, Tensor]] = None     # keep_slot_major
        if backend in ("auto", "cpp") and self.k_ring.device.type == "cpu":
            cpu_kernels_available()        # build now, on the host: never inside a compiled region,
            kivi_arith_default()           # and read KVC_KIVI_ARITH (the attention's arithmetic) there too

    # -------------------------------------------------------------- helpers
    def row_tensors(self, row: int, slots: int) -> list[Tensor]:
        """Row `row` of every buffer over its first `slots` slots (whole key groups) and the ring."""
        c = -(-slots // self.group) * self.group
        return [self.k_packed[row, :, :c], self.k_scale[row, :, :c // self.group], self.k_min[row, :, :c // self.group],
                self.v_packed[row, :, :c], self.v_scale[row, :, :c], self.v_min[row, :, :c],
                self.k_ring[row], self.v_ring[row]]

    def static_tensors(self) -> list[Tensor]:
        """Every buffer, the slot-major copy included (what a CUDA graph reads and writes in place)."""
        return [self.k_packed, self.k_scale, self.k_min, self.v_packed, self.v_scale, self.v_min, self.k_ring,
                self.v_ring, *(self.slot_words or ())]

    @property
    def buffers(self) -> KIVIBuffers:
        return KIVIBuffers(self.k_packed, self.k_scale, self.k_min, self.v_packed, self.v_scale, self.v_min,
                           self.k_ring, self.v_ring, self.bits, self.group)

    @property
    def reader_buffers(self) -> KIVIBuffers:
        """`buffers` with the slot-major words when kept (`keep_slot_major`): what sparse reads take."""
        if self.slot_words is None:
            return self.buffers
        return self.buffers._replace(k_packed=self.slot_words[0], v_packed=self.slot_words[1])

    def keep_slot_major(self) -> None:
        """Keep a slot-major copy of the packed words from now on (k, v [B, H, C, W] contiguous; every write
        refreshes the slots it touched): a sparse read of one slot is then one contiguous read of its W
        words, where the token-contiguous words cost a cache line per word row (dense reads keep using
        those).  Idempotent."""
        if self.slot_words is None:
            self.slot_words = (self.k_packed.contiguous(), self.v_packed.contiguous())

    def refresh_slot_major(self, row: int) -> None:
        """Row `row` of the slot-major copy from the words (after the row's buffers were copied in whole)."""
        if self.slot_words is not None:
            self.slot_words[0][row].copy_(self.k_packed[row])
            self.slot_words[1][row].copy_(self.v_packed[row])

    def _cpp(self, k: Tensor) -> bool:
        """Whether the C++ write ops take this store (fp32 CPU buffers, D / G <= 16, 16 | D <= 128, G <= 64)."""
        return use_cpu_kernel(self.backend, self.dtype == torch.float32 and k.device.type == "cpu"
                              and self.head_dim // self.group <= 16 and self.head_dim % 16 == 0
                              and self.head_dim <= 128 and self.group <= 64)

    def in_ring(self, pos: Tensor, now: Tensor) -> Tensor:
        """bool like pos: the slot holds one of the newest R positions, whose exact K and V are ring row
        pos % R (values are read from there; keys only in their residual, `ring_flags`)."""
        return ring_flags(pos, now, self.residual)[1]

    def _slot_pos(self, pos: Tensor, idx: Tensor) -> Tensor:
        """Positions [B, H, m] of slots idx [B, H, m] (-1 past the policy's S slots)."""
        S = pos.shape[2]
        got = pos.expand(idx.shape[0], idx.shape[1], S).gather(2, idx.clamp(max=S - 1))
        return torch.where(idx < S, got, -1)

    def _keys(self, a: int, b: int) -> Tensor:
        """Dequantized keys of the whole groups of slots [a, b) -> [B, H, b - a, D] fp32."""
        G = self.group
        qt = QuantizedTensor(self.k_packed[:, :, a:b], self.k_scale[:, :, a // G:b // G],
                             self.k_min[:, :, a // G:b // G], self.bits, G)
        return dequantize_keys(qt, torch.float32)

    # -------------------------------------------------------------- writes
    def write_range(self, start: int, k: Tensor, v: Tensor, pos: Tensor, now: Tensor) -> None:
        """k, v [B, H, T, D] into slots [start, start + T) (host int; pos already holds their
        positions): the key groups they touch are requantized in one call, the values quantized per
        token, the young ones written to the ring.  On fp32 CPU storage the C++ twin does it
        (kernels/kivi_kernels.cpp, bit for bit), else `write_range_torch`."""
        if self._cpp(k):
            kivi_write_range_cpu(self.buffers, start, k, v, pos, now)
        else:
            self.write_range_torch(start, k, v, pos, now)
        if self.slot_words is not None:
            G, end = self.group, start + k.shape[2]
            a, b = start // G * G, -(-end // G) * G
            self.slot_words[0][:, :, a:b] = self.k_packed[:, :, a:b]
            self.slot_words[1][:, :, start:end] = self.v_packed[:, :, start:end]

    def write_range_torch(self, start: int, k: Tensor, v: Tensor, pos: Tensor, now: Tensor) -> None:
        """`write_range` in torch ops (the reference, and the path on other devices and dtypes)."""
        B, H, T, D = k.shape
        G, R = self.group, self.residual
        end = start + T
        a, b = start // G * G, -(-end // G) * G
        idx = torch.arange(a, b, device=k.device)[None, None].expand(B, H, b - a)
        pm = self._slot_pos(pos, idx)
        young = self.in_ring(pm, now)
        x = torch.where(young[..., None], ring_rows(self.k_ring, pm), self._keys(a, b))
        x = torch.cat([x[:, :, :start - a], k.float(), x[:, :, end - a:]], dim=2)
        qk = quantize_keys(x, self.bits, G, include=pm >= 0, dtype=self.dtype)
        self.k_packed[:, :, a:b] = qk.packed
        self.k_scale[:, :, a // G:b // G] = qk.scale
        self.k_min[:, :, a // G:b // G] = qk.minimum
        qv = quantize_values(v, self.bits, G, dtype=self.dtype)
        self.v_packed[:, :, start:end] = qv.packed
        self.v_scale[:, :, start:end] = qv.scale
        self.v_min[:, :, start:end] = qv.minimum
        pn, yn = pm[:, :, start - a:end - a], young[:, :, start - a:end - a]
        rows = torch.where(yn, pn.remainder(R), R)[..., None].expand(-1, -1, -1, D)   # row R: discarded
        for ring, new in ((self.k_ring, k), (self.v_ring, v)):
            spill = torch.cat([ring, ring.new_zeros(B, H, 1, D)], dim=2)
            spill.scatter_(2, rows, new.to(self.dtype))
            ring.copy_(spill[:, :, :R])

    def write(self, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, now: Tensor,
              where: Optional[Tensor] = None) -> None:
        """One token per row and head: k, v [B, H, 1, D] into slot [B, H] (pos already holds its
        position); where [B, H] bool: write only there (elsewhere nothing changes, not even a
        requantization).  Requantizes the slot's key group (module docstring).  On fp32 CPU storage
        the C++ twin does it (kernels/kivi_kernels.cpp), on CUDA one Triton launch
        (kernels/kivi_write_triton.py), both bit for bit; else `write_torch`."""
        if self._cpp(k):                                # (the C++ write refreshes the slot-major copy too)
            kivi_write_cpu(self.buffers, slot, k, v, pos, now, where, self.slot_words)
            return
        if resolve_backend(self.backend, k, self.k_ring) == "triton" and write_triton_supported(self.buffers):
            kivi_write_triton(self.buffers, slot, k, v, pos, now, where)
        else:
            self.write_torch(slot, k, v, pos, now, where)
        if self.slot_words is not None:                 # the slot's key group and its value
            G, W = self.group, self.k_packed.shape[-1]
            group = (slot // G * G)[..., None] + torch.arange(G, device=slot.device)          # [B, H, G]
            for copy, words, at in ((self.slot_words[0], self.k_packed, group), (self.slot_words[1], self.v_packed,
                                                                                 slot[..., None])):
                at = at[..., None].expand(-1, -1, -1, W)
                copy.scatter_(2, at, words.gather(2, at))

    def write_torch(self, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, now: Tensor,
                    where: Optional[Tensor] = None) -> None:
        """`write` in torch ops (the reference, and the path on other devices and dtypes)."""
        B, H, _, D = k.shape
        G, R, W = self.group, self.residual, self.k_packed.shape[-1]
        g = (slot // G)[..., None]                                                 # [B, H, 1]
        idx = g * G + torch.arange(G, device=k.device)                             # [B, H, G]
        at_w, at_g = idx[..., None].expand(-1, -1, -1, W), g[..., None].expand(-1, -1, -1, D)
        old = (self.k_packed.gather(2, at_w), self.k_scale.gather(2, at_g), self.k_min.gather(2, at_g))
        x = dequantize_keys(QuantizedTensor(*old, self.bits, G), torch.float32)  # [B, H, G, D]
        pm = self._slot_pos(pos, idx)
        me = idx == slot[..., None]
        x = torch.where(self.in_ring(pm, now)[..., None], ring_rows(self.k_ring, pm), x)
        x = torch.where(me[..., None], k.float(), x)
        qk = quantize_keys(x, self.bits, G, include=(pm >= 0) | me, dtype=self.dtype)
        at_s = slot[:, :, None, None]
        at_v, at_c = at_s.expand(-1, -1, 1, W), at_s.expand(-1, -1, 1, D // G)
        qv = quantize_values(v, self.bits, G, dtype=self.dtype)
        writes = [(self.k_packed, at_w, qk.packed, old[0]), (self.k_scale, at_g, qk.scale, old[1]),
                  (self.k_min, at_g, qk.minimum, old[2]), (self.v_packed, at_v, qv.packed, None),
                  (self.v_scale, at_c, qv.scale, None), (self.v_min, at_c, qv.minimum, None)]
        p_slot = pm.gather(2, slot[..., None] - g * G)                            # [B, H, 1]
        ring_ok = self.in_ring(p_slot, now)[..., 0]
        if where is not None:
            ring_ok = ring_ok & where
        row = p_slot.remainder(R)[..., None].expand(-1, -1, -1, D)
        for ring, new in ((self.k_ring, k), (self.v_ring, v)):
            writes.append((ring, row, new.to(self.dtype), None))
        keep = None if where is None else ~where[:, :, None, None]
        for buf, at, new, prev in writes:
            if buf is self.k_ring or buf is self.v_ring:
                new = torch.where(ring_ok[:, :, None, None], new, buf.gather(2, at))
            elif keep is not None:
                new = torch.where(keep, buf.gather(2, at) if prev is None else prev, new)
            buf.scatter_(2, at, new)

    # -------------------------------------------------------------- reads
    def gather(self, idx: Tensor, pos: Tensor, now: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, N, D] fp32 of slots idx [B, H, N]: only those rows are dequantized (each key
        with its group's scale/minimum), residual ones come from the ring (kernels.kivi_attention)."""
        return kivi_gather(self.buffers, idx, pos, now)

    def dequantized(self, pos: Tensor, now: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, n, D] fp32 of slots [0, n), exactly what attention reads.  A full copy: for
        tests and host-side one-offs (a later prompt chunk, SimLayerKV's trim), never per decode step."""
        G = self.group
        k = self._keys(0, -(-n // G) * G)[:, :, :n]
        v = dequantize_values(QuantizedTensor(self.v_packed[:, :, :n], self.v_scale[:, :, :n],
                                              self.v_min[:, :, :n], self.bits, G), torch.float32)
        key_exact, value_exact = ring_flags(pos[..., :n], now, self.residual)
        return (torch.where(key_exact[..., None], ring_rows(self.k_ring, pos[..., :n]), k),
                torch.where(value_exact[..., None], ring_rows(self.v_ring, pos[..., :n]), v))

    def scores(self, qg: Tensor, pos: Tensor, now: Tensor, n: int) -> Tensor:
        """qg . k_t for slots t < n: qg [B, H, Gq, D] fp32 (any scale folded in) -> [B, H, Gq, n]."""
        p, ne = whole_groups(pos, n, self.group, -1)
        return kivi_scores(qg, self.buffers, p, now, ne)[..., :n]

    def key_norms(self, pos: Tensor, now: Tensor, n: int) -> Tensor:
        """|k_t| [B, H, n] fp32 of slots t < n (packed keys dequantized block by block)."""
        nt = -(-n // self.group) * self.group
        if torch.compiler.is_compiling():      # Inductor fuses the dequantization into the reduction
            norms = self._keys(0, nt).norm(dim=-1)
        else:
            norms = torch.cat([self._keys(c, min(c + CHUNK, nt)).norm(dim=-1) for c in range(0, nt, CHUNK)], 2)
        p = pos[..., :n].expand(norms.shape[0], norms.shape[1], n)
        ring = self.k_ring.float().norm(dim=-1).gather(2, p.remainder(self.residual))
        return torch.where(ring_flags(p, now, self.residual)[0], ring, norms[..., :n])

    def cosine(self, k: Tensor, pos: Tensor, now: Tensor, n: int) -> Tensor:
        """Cosine similarity of k [B, H, 1, D] with the key of every slot t < n -> [B, H, n] fp32
        (as F.normalize: norms clamped at 1e-12)."""
        dots = self.scores(k.float(), pos, now, n)[:, :, 0]
        eps = 1e-12
        return dots / (k.float().norm(dim=-1).clamp_min(eps) * self.key_norms(pos, now, n).clamp_min(eps))

    def attend(self, q: Tensor, visible: Tensor, pos: Tensor, now: Tensor, n: int,
               scale: Optional[float] = None, idx: Optional[Tensor] = None, valid: Optional[Tensor] = None) -> Tensor:
        """q [B, H_q, 1, D] -> [B, H_q, 1, D]: softmax attention over the visible slots t < n
        (visible, pos [B, H or 1, >= n]), or over the slots idx [B, H or H_q, N] where valid (the sparse
        readers): packed words and the residual in one op (kernels.kivi_attention)."""
        return kivi_attention(q, self.buffers, pos, visible, now, n, scale, idx, valid, backend=self.backend)

    def attend_and_probs(self, q: Tensor, visible: Tensor, pos: Tensor, now: Tensor, k: Tensor, v: Tensor,
                         n: int) -> tuple[Tensor, Tensor, Tensor]:
        """cache.scoring.attend_with_new over the packed slots t < n plus the new token k, v [B, H, 1, D]:
        (out [B, H_q, 1, D], p_old [B, H, Gq, n], p_new [B, H, Gq, 1]), one joint softmax in fp32."""
        B, Hq, _, D = q.shape
        Gq = Hq // self.heads
        qg = q.float().view(B, self.heads, Gq, D) / math.sqrt(D)
        p, ne = whole_groups(pos, n, self.group, -1)
        vis, _ = whole_groups(visible, n, self.group, False)
        s_old = kivi_scores(qg, self.buffers, p, now, ne).masked_fill(~vis[:, :, None], NEVER)
        s_new = (qg * k.float()).sum(-1, keepdim=True)
        p_old, p_new = joint_softmax(s_old, s_new)
        out = kivi_values(p_old, self.buffers, p, now, ne) + p_new * v.float()
        return out.to(q.dtype).reshape(B, Hq, 1, D), p_old[..., :n], p_new

    # -------------------------------------------------------------- memory
    def slot_bytes(self) -> int:
        """Bytes one slot adds (all rows and heads): its packed K and V words, its value scales and
        minimums, and 1/G of its key group's scales and minimums (the ring is a fixed extra)."""
        def row(t: Tensor) -> int:
            return t[:, :, 0].numel() * t.element_size()
        return (row(self.k_packed) + row(self.v_packed) + row(self.v_scale) + row(self.v_min)
                + (row(self.k_scale) + row(self.k_min)) // self.group)

    def nbytes(self, n: Optional[int] = None) -> int:
        """Bytes of every buffer, or of what holds slots [0, n): their packed words (and slot-major copies),
        scales and minimums (keys: whole groups) and min(n, R) ring rows of K and V."""
        bufs = (self.k_packed, self.k_scale, self.k_min, self.v_packed, self.v_scale, self.v_min,
                self.k_ring, self.v_ring) + (self.slot_words or ())
        if n is None:
            return sum(t.numel() * t.element_size() for t in bufs)

        def rows(t: Tensor, r: int) -> int:
            return t[:, :, :r].numel() * t.element_size()
        G, ng = self.group, -(-n // self.group)
        copies = 0 if self.slot_words is None else rows(self.slot_words[0], ng * G) + rows(self.slot_words[1], n)
        return (rows(self.k_packed, ng * G) + rows(self.k_scale, ng) + rows(self.k_min, ng) + rows(self.v_packed, n)
                + rows(self.v_scale, n) + rows(self.v_min, n) + 2 * rows(self.k_ring, min(n, self.residual)) + copies)


# ------------------------------------------------------------------------------------ policies
STORAGE_ERROR = ("KIVI-packed slots (--kv-bits {bits}): storage(layer) has no full-precision tensors; use "
                 "kv_store(layer) and SlotStore.gather (see cache/quantized.py)")


class KIVIDenseCache(FullCache):
    """`full` with KIVI-packed storage: every token kept, the newest R in the ring.  An ordinary subclass
    of cache.full.FullCache (`with_kv_bits` returns one in place of the plain `full`)."""

    name = "full"
    storage_kind = "kivi"
    fused_dense_decode = False          # packed slots: decode() below
    prefix_reuse = False                # a later chunk reads the prefix dequantized: chunk boundaries matter

    def __init__(self, bits: int = 4, group: int = GROUP, residual: int = RESIDUAL, backend: str = "auto"):
        check_format(None, bits, group, residual)
        self.kv_bits, self.kv_group, self.kv_residual, self.backend = bits, group, residual, backend
        self.stores = self.now = None       # per layer a SlotStore; [B] each row's newest position (setup)

    def allocate_kv(self, args, max_batch_size: int, max_seq_length: int, dtype: torch.dtype, device):
        """One packed SlotStore per layer, as both K and V (FullCache.setup keeps the rest)."""
        # one spare group: reads go over whole groups of the live length, which then never reaches
        # the buffers' size (compiled graphs would otherwise change when it does)
        spare = max_seq_length + self.kv_group
        self.stores = [SlotStore(max_batch_size, args.n_kv_heads, args.head_dim, spare, self.kv_bits,
                                 self.kv_group, self.kv_residual, dtype, device, self.backend)
                       for _ in range(args.n_layers)]
        return self.stores, self.stores

    def read_slots(self, input_pos: Tensor, n: int) -> None:
        """FullCache's, once per forward (begin and begin_static), and `now` in place: [B] the newest position,
        the ring holds (now - R, now]."""
        super().read_slots(input_pos, n)
        self.now.copy_(input_pos.amax(-1))

    def kv_buffers(self) -> list[Tensor]:
        """Every layer's packed buffers and ring, and `now` (the ring's rule reads it)."""
        return [t for store in self.stores for t in store.static_tensors()] + [self.now]

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        store, pos = self.stores[layer], self.pos[:, None]
        if self.start:      # a later prompt chunk reads the stored slots (a dequantized copy, prefill only)
            kd, vd = store.dequantized(pos, self.pos[:, self.start - 1], self.start)
            out = grouped_attention(q, torch.cat([kd.to(k.dtype), k], 2), torch.cat([vd.to(v.dtype), v], 2), self.mask)
        else:
            out = grouped_attention(q, k, v, self.mask)
        store.write_range(self.start, k, v, pos, self.now)
        return out

    def store(self, layer: int, k: Tensor, v: Tensor):
        """Write the decode token k, v [B, H_kv, 1, D] into its row's next slot; returns the slot (FullCache.store)."""
        pos = self.pos[:, None]
        slot = self.start if self.aligned else self.slot
        at = pos.new_full(k.shape[:2], slot) if self.aligned else slot[:, None].expand(k.shape[:2])
        self.stores[layer].write(at, k, v, pos, self.now)
        return slot

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.store(layer, k, v)
        return self.stores[layer].attend(q, self.mask[:, :1], self.pos[:, None], self.now, self.n_read)

    def storage(self, layer: int):
        raise NotImplementedError(STORAGE_ERROR.format(bits=self.kv_bits))

    def row_tensors(self, row: int, n: int) -> list[Tensor]:
        return [t for s in self.stores for t in s.row_tensors(row, n)] + [self.pos[row, :n]]

    def reset(self) -> None:
        super().reset()
        self.now = torch.full_like(self.length, -1)     # [B] each row's newest position (set by begin)

    def adopt(self, row: int, other: "KIVIDenseCache", other_row: int = 0) -> None:
        super().adopt(row, other, other_row)
        self.now[row] = other.now[other_row]

    def kv_store(self, layer: int) -> tuple[SlotStore, Tensor, Tensor]:
        """(store, pos [B, 1, n], now [B]): the packed slots a reader gathers from, n the slots this step reads
        (n_read)."""
        return self.stores[layer], self.pos[:, None, :self.n_read], self.now

    def kept_positions(self, layer: int) -> Tensor:
        return self.pos[:, None, :self.n_filled].expand(-1, self.stores[layer].heads, -1)

    def kv_bytes(self) -> dict:
        live = sum(s.nbytes(self.n_filled) for s in self.stores) if self.n_filled else 0   # (longest row)
        return {"allocated": sum(s.nbytes() for s in self.stores), "live": live, "read_per_step": live}

    def describe(self) -> dict:
        return {**super().describe(), **kv_describe(self.kv_bits, self.kv_group, self.kv_residual)}


class KIVISlots:
    """KIVI-packed slots for an eviction policy (`with_kv_bits` puts one in `policy.slots`): one SlotStore per
    layer (`k[layer] is v[layer]`), the methods of cache.slots.DenseSlots; the residual follows now = the
    newest query position (q_pos.amax(-1))."""

    def __init__(self, bits: int = 4, group: int = GROUP, residual: int = RESIDUAL, backend: str = "auto"):
        check_format(None, bits, group, residual)
        self.bits, self.group, self.residual, self.backend = bits, group, residual, backend

    def setup(self, n_layers: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        check_format(head_dim, self.bits, self.group, self.residual)
        self.shape, self.dtype, self.device = (batch, heads, head_dim), dtype, device
        self.k: list = [None] * n_layers
        self.v = self.k                       # one SlotStore holds a layer's keys and values

    def allocate(self, layer: int, capacity: int) -> None:
        B, H, D = self.shape
        self.k[layer] = SlotStore(B, H, D, capacity, self.bits, self.group, self.residual, self.dtype, self.device,
                                  self.backend)

    def row(self, layer: int, row: int) -> list[Tensor]:
        store = self.k[layer]
        return store.row_tensors(row, store.k_packed.shape[2])

    def write_kept(self, layer: int, kc: Tensor, vc: Tensor, pos: Tensor, q_pos: Tensor) -> None:
        self.k[layer].write_range(0, kc, vc, pos, q_pos.amax(-1))

    def write(self, layer: int, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, q_pos: Tensor,
              where: Optional[Tensor] = None) -> None:
        self.k[layer].write(slot, k, v, pos, q_pos.amax(-1), where)

    def read(self, layer: int, slot: Tensor, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        return self.k[layer].gather(slot[..., None], pos, q_pos.amax(-1))

    def cosine(self, layer: int, k: Tensor, pos: Tensor, q_pos: Tensor) -> Tensor:
        return self.k[layer].cosine(k, pos, q_pos.amax(-1), pos.shape[2])

    def attend(self, layer: int, q: Tensor, visible: Tensor, pos: Tensor, q_pos: Tensor) -> Tensor:
        return self.k[layer].attend(q, visible, pos, q_pos.amax(-1), pos.shape[2])

    def attend_and_probs(self, layer: int, q: Tensor, k: Tensor, v: Tensor, visible: Tensor, pos: Tensor,
                         q_pos: Tensor):
        return self.k[layer].attend_and_probs(q, visible, pos, q_pos.amax(-1), k, v, pos.shape[2])

    def dense(self, layer: int, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """A dequantized copy in the compute dtype (host-side one-offs only)."""
        k, v = self.k[layer].dequantized(pos, q_pos.amax(-1), pos.shape[2])
        return k.to(self.dtype), v.to(self.dtype)

    def static_tensors(self) -> list[Tensor]:
        """Every allocated layer's packed buffers and ring (a static decode step's)."""
        return [t for store in self.k if store is not None for t in store.static_tensors()]

    def tensors(self, layer: int):
        raise NotImplementedError(STORAGE_ERROR.format(bits=self.bits))

    def kv_store(self, layer: int, pos: Tensor, q_pos: Tensor) -> tuple[SlotStore, Tensor, Tensor]:
        """(store, pos [B, H, S], now [B]): the packed slots a reader would gather from."""
        return self.k[layer], pos, q_pos.amax(-1)

    def nbytes(self, layer: int, n: Optional[int] = None) -> int:
        return self.k[layer].nbytes(n)

    def describe(self) -> dict:
        return kv_describe(self.bits, self.group, self.residual)


def kv_describe(bits: int, group: int, residual: int) -> dict:
    return {"kv_bits": bits, "kv_group_size": group, "kv_residual": residual}


def with_kv_bits(policy, bits: int, group: int = GROUP, residual: int = RESIDUAL, backend: str = "auto"):
    """`policy` (not yet set up) with its K/V stored at `bits` (G = group, R = residual): 16 returns it
    unchanged; 4 or 2 (8) give an eviction policy KIVI-packed slots in place (`policy.slots =
    KIVISlots(...)`; its parameters and selection code are untouched) and return it, and replace the
    plain `full` cache by a KIVIDenseCache.  A sparse reader (hshare, ds, quest, or STORAGE+READER) gets
    its storage policy packed and reads it through `kv_store` (cache/sparse_read.py).  ValueError for POD,
    storage that is already packed or in another dtype, or bad arguments."""
    if bits == 16:
        return policy
    check_format(None, bits, group, residual)
    name = getattr(policy, "name", type(policy).__name__)
    if policy.kv_bits != 16:
        raise ValueError(f"--kv-bits {bits}: policy {name!r} already stores K/V at {policy.kv_bits} bits")
    if policy.is_sparse_reader:
        policy.inner = with_kv_bits(policy.inner, bits, group, residual, backend)
        policy.storage_ = InnerStorage(policy.inner)
        return policy
    if policy.storage_kind == "dense":
        return KIVIDenseCache(bits, group, residual, backend)
    if policy.storage_kind != "slots":
        raise ValueError(f"--kv-bits {bits}: policy {name!r} has no KIVI storage yet (supported: full, the eviction "
                         f"policies, and the sparse readers over any of them; pod keeps its own storage)")
    policy.slots = KIVISlots(bits, group, residual, backend)
    return policy

