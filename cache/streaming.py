"""StreamingLLM (Xiao et al., 2023): the first `n_sink` tokens plus the most recent ones.

budget = n_sink + n_recent slots per layer and KV head.  At prefill the prompt's first n_sink
and last `n_recent` tokens are kept; at every decode step the oldest non-sink token is evicted,
so memory stays flat for any generation length.  Keys keep their original positions.
"""
from torch import Tensor

from cache.base import NEVER, EvictionPolicy, recent_and_sinks


class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    params = {**EvictionPolicy.params,
              "n_sink": (int, 4, "attention-sink tokens always kept (the first of the sequence)")}

    def validate(self) -> None:
        super().validate()
        if self.n_sink < 0 or self.budget <= self.n_sink:
            raise ValueError(f"budget ({self.budget}) must exceed n_sink ({self.n_sink})")

    @property
    def n_recent(self) -> int:
        return self.budget - self.n_sink

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        keep = recent_and_sinks(q_pos, self.n_sink, self.n_recent)
        return q_pos.float().masked_fill(~keep, NEVER)[:, None, :].expand(-1, n_heads, -1)

    def decode_victim(self, layer: int) -> Tensor:
        pos = self.pos[layer]
        return self.lowest(layer, pos.float(), pos < self.n_sink)   # the oldest non-sink
