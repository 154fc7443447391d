"""StreamingLLM (Xiao et al., 2023): the first `n_sink` tokens plus the most recent ones.

budget = n_sink + window slots per layer and KV head.  At prefill the prompt's first n_sink
and last `window` tokens are kept; at every decode step the oldest non-sink token is evicted,
so memory stays flat for any generation length.  Keys keep their original positions.
"""
import torch
from torch import Tensor

from cache.base import NEVER, EvictionPolicy


class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    params = {**EvictionPolicy.params,
              "n_sink": (int, 4, "attention-sink tokens always kept (the first of the sequence)")}

    def validate(self) -> None:
        super().validate()
        if self.n_sink < 0 or self.budget <= self.n_sink:
            raise ValueError(f"budget ({self.budget}) must exceed n_sink ({self.n_sink})")

    @property
    def window(self) -> int:
        return self.budget - self.n_sink

    def prefill_scores(self, layer: int, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor) -> Tensor:
        length = q_pos.max(dim=-1, keepdim=True).values + 1                # [B, 1] per sequence
        keep = (q_pos >= 0) & ((q_pos < self.n_sink) | (q_pos >= length - self.window))
        scores = torch.where(keep, q_pos.float(), NEVER)
        return scores[:, None, :].expand(-1, k.shape[1], -1)

    def decode_victim(self, layer: int) -> Tensor:
        pos = self.pos[layer]                                              # [B, H, C]
        age = torch.where(pos < self.n_sink, torch.iinfo(pos.dtype).max, pos)
        age = torch.where(pos < 0, -1, age)                                # empty slots first
        return age.argmin(dim=-1)
