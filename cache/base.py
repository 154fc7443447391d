"""Shared mechanics of the policies that keep a subset of tokens (eviction policies).

Storage per layer l (capacity C_l slots, allocated once in `setup`):
    k, v  [B, H_kv, C_l, D]   keys (rotated at their absolute position) and values
    pos   [B, H_kv, C_l]      absolute position held by each slot, -1 = empty
Each KV head keeps its own tokens.  The contract is the one documented on `model.DenseCache`.

Prefill: the whole prompt comes in one pass (`prefill_in_one_pass`), attention over it is full
and causal, then each layer keeps the top-C_l tokens of the policy's `prefill_scores` (so the
first generated token equals the full cache's).  Decode: the new token overwrites the slot the
policy's `decode_victim` names (empty slots first), per sequence and head, without host syncs;
attention reads the layer's C_l slots (empty ones masked), so its cost follows the budget.
"""
from __future__ import annotations

import torch
from torch import Tensor

from model import ModelArgs, attention_mask, grouped_attention

NEVER = float("-inf")


def select_top(scores: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """The `capacity` best columns of scores [B, H, T], returned in column order.

    Returns (idx [B, H, capacity], valid [B, H, capacity]); valid is False where no keepable
    column was left (score -inf, or T < capacity), and such idx point at a real column.  The
    output shape never depends on T, so compiled prefill graphs need no T-vs-capacity guard."""
    B, H, T = scores.shape
    padded = torch.cat([scores, scores.new_full((B, H, capacity), NEVER)], dim=-1)
    top, idx = padded.topk(capacity, dim=-1)
    order = idx.argsort(dim=-1)
    idx, top = idx.gather(-1, order), top.gather(-1, order)
    return idx.clamp(max=T - 1), top > NEVER


class EvictionPolicy:
    """Base class: a policy declares `params`, and implements `prefill_scores` and
    `decode_victim` (and `layer_capacity` when layers get different budgets)."""

    name = "eviction"
    params: dict = {"budget": (int, 256, "tokens kept per layer and KV head, window included")}
    prefill_in_one_pass = True

    def __init__(self, **kwargs):
        for key, (kind, default, _) in self.params.items():
            setattr(self, key, kind(kwargs.pop(key, default)))
        if kwargs:
            raise ValueError(f"unknown parameter(s) {sorted(kwargs)} for policy {self.name!r}")
        self.validate()

    def validate(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be positive, got {self.budget}")

    # ----------------------------------------------------------------- policy hooks
    def layer_capacity(self, layer: int, args: ModelArgs, max_seq_length: int) -> int:
        return min(self.budget, max_seq_length)

    def prefill_scores(self, layer: int, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor) -> Tensor:
        """Keep-priority [B, H_kv, T] of the prompt tokens (-inf: never keep)."""
        raise NotImplementedError

    def decode_victim(self, layer: int) -> Tensor:
        """Slot [B, H_kv] to overwrite with the new token (an empty slot while there is one)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- contract
    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype, device) -> None:
        B, H, D = max_batch_size, args.n_kv_heads, args.head_dim
        self.capacities = [self.layer_capacity(i, args, max_seq_length) for i in range(args.n_layers)]
        self.k = [torch.zeros(B, H, c, D, dtype=dtype, device=device) for c in self.capacities]
        self.v = [torch.zeros(B, H, c, D, dtype=dtype, device=device) for c in self.capacities]
        self.pos = [torch.full((B, H, c), -1, dtype=torch.long, device=device) for c in self.capacities]
        self.group = args.n_heads // args.n_kv_heads
        self.sliding_window = args.sliding_window
        self.max_seq_length = max_seq_length
        self.reset()

    def reset(self) -> None:
        for p in self.pos:
            p.fill_(-1)
        self.n_filled = 0       # tokens seen so far (prompt + generated), a host int
        self.prompt_length = 0
        self.q_pos = None

    def begin(self, input_pos: Tensor) -> None:
        T = input_pos.shape[1]
        if self.n_filled and T > 1:
            raise ValueError(f"policy {self.name!r} takes the prompt in one pass; got a second chunk")
        self.q_pos = input_pos
        if T > 1 or not self.n_filled:
            self.prompt_length = T
            self.mask = attention_mask(input_pos, input_pos, self.group, self.sliding_window)
        self.n_filled += T

    def used_slots(self, layer: int) -> int:
        """Slots any sequence may have filled so far (empty slots fill lowest index first)."""
        return min(self.capacities[layer], self.n_filled)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = grouped_attention(q, k, v, self.mask)
        scores = self.prefill_scores(layer, q, k, v, self.q_pos)
        idx, valid = select_top(scores, self.capacities[layer])
        gather = idx[..., None].expand(-1, -1, -1, k.shape[-1])
        self.k[layer].copy_(k.gather(2, gather))
        self.v[layer].copy_(v.gather(2, gather))
        pos = self.q_pos[:, None, :].expand(-1, k.shape[1], -1).gather(2, idx)
        self.pos[layer].copy_(torch.where(valid, pos, -1))
        return out

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        slot = self.decode_victim(layer)                                   # [B, H]
        kc, vc, pc = self.k[layer], self.v[layer], self.pos[layer]
        at = slot[:, :, None, None].expand(-1, -1, 1, k.shape[-1])
        kc.scatter_(2, at, k)
        vc.scatter_(2, at, v)
        pc.scatter_(2, slot[:, :, None], self.q_pos[:, None, :].expand(-1, pc.shape[1], 1))
        # all C_l slots, empty ones masked: the cost is bounded by the budget, and the shape does
        # not change when the cache fills up (a compiled step would otherwise specialize on it)
        visible = pc >= 0                                                  # [B, H, C]
        if self.sliding_window:
            visible &= self.q_pos[:, None, :] - pc < self.sliding_window
        mask = visible[:, :, None, :].expand(-1, -1, self.group, -1)       # one query per group head
        return grouped_attention(q, kc, vc, mask)

    def end_prefill(self) -> None:
        pass

    def kept_positions(self, layer: int) -> Tensor:
        return self.pos[layer][:, :, :self.used_slots(layer)]

    def kv_bytes(self) -> dict:
        def per_slot(t):  # bytes of one slot of one layer (all batch rows and heads)
            return t[:, :, 0].numel() * t.element_size()
        allocated = sum(per_slot(k) * c * 2 for k, c in zip(self.k, self.capacities))
        live = sum(per_slot(k) * self.used_slots(i) * 2 for i, k in enumerate(self.k))
        return {"allocated": allocated, "live": live, "read_per_step": allocated}

    def describe(self) -> dict:
        d = {"policy": self.name, **{k: getattr(self, k) for k in self.params}}
        if hasattr(self, "capacities"):
            d["capacity_per_layer"] = sorted(set(self.capacities))
            if self.prompt_length and self.prompt_length <= min(self.capacities):
                d["note"] = f"budget >= prompt ({self.prompt_length} tokens): the prompt is kept whole"
        return d
