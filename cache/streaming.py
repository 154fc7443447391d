"""StreamingLLM (Xiao et al., 2023): the first `n_sink` tokens plus the most recent ones.

budget = n_sink + n_recent slots per layer and KV head.  At prefill the prompt's first n_sink
and last `n_recent` tokens are kept; at every decode step the oldest non-sink token is evicted,
so memory stays flat for any generation length (`decode_evict=false`: kvpress's StreamingLLMPress
rule, the window fixed at prefill and decode tokens appended).  Keys keep their original positions.
The rule is the one-method tier's defaults (cache/scored.py): the sinks and the recent window (budget - n_sink,
per row under a ratio) are always kept, and a token's score is its position (the oldest unprotected one leaves).
"""
from dataclasses import dataclass

from cache.params import sink_param
from cache.scored import ScoredEviction


@dataclass(eq=False)
class StreamingPolicy(ScoredEviction):
    name = "streaming"
    n_sink: int = sink_param(4)

    def validate(self) -> None:
        if self.budget is not None and self.budget < self.min_budget():
            raise ValueError(f"budget ({self.budget}) must exceed n_sink ({self.n_sink})")
        super().validate()

    def min_budget(self) -> int:
        return self.n_sink + 1

    def recent_window(self, layer: int, budget: int) -> int:
        return budget - self.n_sink
