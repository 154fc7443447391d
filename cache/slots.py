"""The dense slot format: how an eviction policy's slots hold K/V by default (`policy.slots`), in the compute
dtype.  cache/quantized.py's KIVISlots holds them KIVI-packed behind the same methods.
"""
from __future__ import annotations

import torch
from torch import Tensor

from cache.scoring import attend_with_new, cosine
from kernels.cpu import decode_attention


def scatter_into(dst: Tensor, dim: int, index: Tensor, src: Tensor) -> None:
    """dst.scatter_(dim, index, src), src in dst's dtype; a 16-bit float dst is scattered as int16 bits (the same
    bytes): PyTorch's CPU scatter of bf16/fp16 widens the whole destination to fp32 and back (~200 us for one
    decode token into a [8, 3, 384, 64] layer, against ~10 us as bits, measured 2026-11-29 on the Intel Xeon)."""
    src = src.to(dst.dtype)
    if dst.dtype in (torch.bfloat16, torch.float16):
        dst, src = dst.view(torch.int16), src.view(torch.int16)
    dst.scatter_(dim, index, src)


class DenseSlots:
    """How an eviction policy's slots hold K/V by default: in the compute dtype, per layer k, v [B, H, C, D]
    (None until the layer is allocated).  cache/quantized.py's `KIVISlots` holds them KIVI-packed behind
    the same methods (`with_kv_bits` puts one in `policy.slots`).  The methods that touch slots take the
    layer's slot table pos [B, H, C] (-1 = empty) and the current query positions q_pos [B, T]; this
    format needs neither."""

    bits, group, residual = 16, 0, 0      # kv_bits, kv_group, kv_residual of the policy

    def setup(self, n_layers: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Host side: the shapes; no layer allocated yet."""
        self.shape, self.dtype, self.device = (batch, heads, head_dim), dtype, device
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers

    def allocate(self, layer: int, capacity: int) -> None:
        """The layer's buffers, `capacity` slots (host side)."""
        B, H, D = self.shape
        self.k[layer] = torch.zeros(B, H, capacity, D, dtype=self.dtype, device=self.device)
        self.v[layer] = torch.zeros(B, H, capacity, D, dtype=self.dtype, device=self.device)

    def row(self, layer: int, row: int) -> list[Tensor]:
        """Row `row` of the layer's buffers (release/adopt copy them)."""
        return [self.k[layer][row], self.v[layer][row]]

    def write_kept(self, layer: int, kc: Tensor, vc: Tensor, pos: Tensor, q_pos: Tensor) -> None:
        """The kept prompt tokens kc, vc [B, H, n, D] into slots [0, n) (pos already holds them)."""
        n = kc.shape[2]
        self.k[layer][:, :, :n] = kc
        self.v[layer][:, :, :n] = vc

    def write(self, layer: int, slot: Tensor, k: Tensor, v: Tensor, pos: Tensor, q_pos: Tensor,
              where: Tensor | None = None) -> None:
        """k, v [B, H, 1, D] into slot [B, H] (pos already holds it); where [B, H] bool: only there."""
        at = slot[:, :, None, None].expand(-1, -1, 1, k.shape[-1])
        kc, vc = self.k[layer], self.v[layer]
        if where is not None:
            keep = ~where[:, :, None, None]
            k = torch.where(keep, kc.gather(2, at), k.to(kc.dtype))
            v = torch.where(keep, vc.gather(2, at), v.to(vc.dtype))
        scatter_into(kc, 2, at, k)
        scatter_into(vc, 2, at, v)

    def read(self, layer: int, slot: Tensor, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, 1, D] held by slot [B, H]."""
        at = slot[:, :, None, None].expand(-1, -1, 1, self.k[layer].shape[3])
        return self.k[layer].gather(2, at), self.v[layer].gather(2, at)

    def cosine(self, layer: int, k: Tensor, pos: Tensor, q_pos: Tensor) -> Tensor:
        """Cosine similarity of k [B, H, 1, D] with every slot's key -> [B, H, C] fp32."""
        return cosine(k, self.k[layer])[:, :, 0]

    def attend(self, layer: int, q: Tensor, visible: Tensor, pos: Tensor, q_pos: Tensor) -> Tensor:
        """Decode attention of q [B, H_q, 1, D] over the visible [B, H, C] slots -> [B, H_q, 1, D]."""
        return decode_attention(q, self.k[layer], self.v[layer], visible)

    def attend_and_probs(self, layer: int, q: Tensor, k: Tensor, v: Tensor, visible: Tensor, pos: Tensor,
                         q_pos: Tensor):
        """`attend_with_new` over the layer's slots plus the new token -> (out, p_old, p_new)."""
        return attend_with_new(q, self.k[layer], self.v[layer], visible, k, v)

    def dense(self, layer: int, pos: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, C, D] of every slot in the compute dtype (the buffers themselves)."""
        return self.k[layer], self.v[layer]

    def tensors(self, layer: int) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H, C, D]: the buffers a sparse reader reads in place (`storage`)."""
        return self.k[layer], self.v[layer]

    def static_tensors(self) -> list[Tensor]:
        """The allocated layers' buffers (a static decode step's, cache.base.EvictionPolicy.static_tensors)."""
        return [t for t in self.k + self.v if t is not None]

    def kv_store(self, layer: int, pos: Tensor, q_pos: Tensor):
        raise NotImplementedError("compute-dtype slots have no packed store: read them through storage(layer)")

    def nbytes(self, layer: int, n: int | None = None) -> int:
        """Bytes of the layer's buffers, or of those holding slots [0, n)."""
        k = self.k[layer]
        return 2 * k[:, :, 0].numel() * k.element_size() * (k.shape[2] if n is None else n)

    def describe(self) -> dict:
        return {}
