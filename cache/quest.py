"""Quest (Tang et al., 2024), decode side: page-level key bounds and top pages by an upper bound.

Per layer and KV head the slots are cut into pages of `page_size` (16) consecutive slots; each page
keeps the element-wise min and max of its keys (post-RoPE; empty slots ignored), built from the inner
storage after prefill and recomputed for the page of every slot a decode token is written to (so the
bounds are exact even when an eviction policy overwrites slots).  At each decode attention, the
page score is Quest's upper bound of q . k over the page, sum_d max(q_d min_d, q_d max_d), combined
over the G query heads of the KV head by `head_agg` (mean: the group's bound sums; max; or query:
every query head its own pages, as Quest does on MHA models).

Selection convention (the same token budget and sink/recent rule as ds and hshare, so the three are
comparable at equal N_c): x sinks + y recent tokens (the current one included) are always read, and
the remaining z = N_c - x - y tokens are the best *pages*: every middle slot takes its page's score
and the top-z slots are read, so whole pages are taken in score order (the last page partially when
z is not a multiple of page_size).  Quest itself always reads the current page instead of
y recent tokens; with y >= page_size this convention reads at least as much of the recent context.
Pages are in slot space: for the full cache slot order is arrival order, as in Quest.

    python engine.py --checkpoint C --policy quest --policy-args preset=long
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from cache.sparse_read import SparseReader, param, select_slots
from cache.slots import scatter_into

BIG = float("inf")


@dataclass(eq=False)
class QuestPolicy(SparseReader):
    name = "quest"
    page_size: int = param(16, "slots per page")

    def validate(self) -> None:
        super().validate()
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    def reset(self) -> None:
        super().reset()
        L = self.args.n_layers
        self.kmin: list = [None] * L
        self.kmax: list = [None] * L

    @staticmethod
    def _bounds(keys: Tensor, ok: Tensor) -> tuple[Tensor, Tensor]:
        """keys [..., n, D], ok [..., n] -> (min, max) [..., D] over the ok rows; 0 when none is ok."""
        kf = keys.float()
        mn = kf.masked_fill(~ok[..., None], BIG).amin(-2)
        mx = kf.masked_fill(~ok[..., None], -BIG).amax(-2)
        has = ok.any(-1)[..., None]
        return torch.where(has, mn, 0.0).to(keys.dtype), torch.where(has, mx, 0.0).to(keys.dtype)

    def build(self, layer: int) -> None:
        ps = self.page_size
        k = self.storage_.full_keys(layer)
        B, H, cap, D = k.shape
        pos = self.storage_.full_positions(layer).expand(B, H, cap)
        n_pages = -(-cap // ps)
        pad = n_pages * ps - cap
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        ok = torch.nn.functional.pad(pos >= 0, (0, pad), value=False)
        self.kmin[layer], self.kmax[layer] = self._bounds(k.view(B, H, n_pages, ps, D), ok.view(B, H, n_pages, ps))

    def index_tensors(self, layer: int, row: int) -> list[Tensor]:
        return [self.kmin[layer][row], self.kmax[layer][row]]

    def index_static_tensors(self) -> list[Tensor]:
        return self.kmin + self.kmax

    def update(self, layer: int, k: Tensor, slot) -> None:
        """Recompute the bounds of the page holding the new token's slot (int: the full cache's, the
        same for every row and head; else [B, H])."""
        ps = self.page_size
        pos = self.storage_.full_positions(layer)
        B, H, cap = self.kmin[layer].shape[0], self.kmin[layer].shape[1], pos.shape[2]
        if not isinstance(slot, Tensor):
            slot = torch.full((B, H), slot, dtype=torch.long, device=pos.device)
        page = slot // ps                                                      # [B, H]
        slots = (page[..., None] * ps + torch.arange(ps, device=slot.device)).clamp(max=cap - 1)
        ok = pos.expand(B, H, cap).gather(2, slots) >= 0
        mn, mx = self._bounds(self.storage_.keys_at(layer, slots), ok)
        at = page[:, :, None, None].expand(B, H, 1, mn.shape[-1])
        scatter_into(self.kmin[layer], 2, at, mn[:, :, None])
        scatter_into(self.kmax[layer], 2, at, mx[:, :, None])

    def scores(self, layer: int, q: Tensor) -> Tensor:
        """Upper-bound scores [B, H_kv, S]: each slot takes its page's bound (summed over the group)."""
        ps = self.page_size
        S = self.step_length(layer)
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        n_pages = (S + ps - 1) // ps
        kmin, kmax = kmin[:, :, :n_pages], kmax[:, :, :n_pages]
        B, H, P, D = kmin.shape
        qg = q.reshape(B, H, -1, D)
        q_pos, q_neg = qg.clamp(min=0), qg.clamp(max=0)        # max(q_d min_d, q_d max_d) = q+ max + q- min
        if self.head_agg == "mean":                            # the group's bounds summed: one matmul per page
            q_pos, q_neg = q_pos.sum(2, keepdim=True), q_neg.sum(2, keepdim=True)
        q_pos, q_neg = q_pos.to(kmax.dtype), q_neg.to(kmin.dtype)
        ub = (torch.matmul(q_pos, kmax.transpose(-1, -2)) + torch.matmul(q_neg, kmin.transpose(-1, -2))).float()
        ub = ub[..., None].expand(*ub.shape, ps).reshape(B, -1, P * ps)[:, :, :S]       # [B, H or H_q, S]
        return ub if self.head_agg == "mean" else self.reduce_query_scores(ub)

    def select(self, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
        s = self.scores(layer, q)
        return select_slots(s, self.select_bias(layer, s.shape[1]), self.n_critical, self.backend)

    def index_bytes(self, live: bool) -> int:
        if not self.built:
            return 0
        return sum(t.numel() * t.element_size() for t in self.kmin + self.kmax if t is not None)

    def read_bytes_per_step(self) -> float:
        L = self.args.n_layers
        bounds = 0
        for layer in range(L):
            n_pages = -(-self.readable_length(layer) // self.page_size)
            t = self.kmin[layer]
            bounds += 2 * t[:, :, 0].numel() * t.element_size() * n_pages
        rows = sum(min(self.n_critical, self.readable_length(layer)) for layer in range(L))
        return bounds + rows * self.kv_row_bytes()
