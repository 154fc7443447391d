"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus sinks and a recent window.

Per layer and KV head the cache holds `budget` tokens: the first `n_sink`, the `n_recent` most
recent, and the heavy hitters: the tokens with the largest accumulated attention (column sums
of the prompt's attention, then every decode step's attention added; GQA: mean over the query
heads of a KV head).  Eviction happens during decode too, one slot per step: the step attends
over the cache plus the new token, adds the probabilities, and the unprotected slot with the
lowest accumulated score makes room for the new token.  The budget never grows.
"""
from torch import Tensor

from dataclasses import dataclass

from cache.base import EvictionPolicy
from cache.params import Budget, DecodeEviction, HeadAgg, recent_param, sink_param
from cache.scoring import column_scores, reduce_heads


@dataclass(eq=False)
class H2OPolicy(DecodeEviction, HeadAgg, Budget, EvictionPolicy):
    name = "h2o"
    n_sink: int = sink_param(4)
    n_recent: int = recent_param(-1, "recent tokens always kept (-1: half of budget - n_sink, the paper's "
                                     "equal heavy/recent split)")
    renamed = {"window": "n_recent"}
    decode_attention = True

    def validate(self) -> None:
        if self.n_recent == -1 and self.budget is not None:     # with a ratio: per row (recent_window)
            self.n_recent = self.paper_recent(self.budget)
        super().validate()
        if self.n_recent < 1 and self.n_recent != -1:
            raise ValueError(f"n_recent must be at least 1, got {self.n_recent}")

    def paper_recent(self, budget: int) -> int:
        """The paper's equal heavy/recent split of `budget`."""
        return max(1, (budget - self.n_sink) // 2)

    def min_budget(self) -> int:
        return self.n_sink + (1 if self.n_recent == -1 else self.n_recent)

    def recent_window(self, layer: int, budget: int) -> int:
        return self.paper_recent(budget) if self.n_recent == -1 else self.n_recent

    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        return {"acc": column_scores(q, k, q_pos, None, self.sliding_window, agg=self.head_agg, k_pos=k_pos)}

    def prefill_queries(self) -> None:
        return None     # every query's attention, summed

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        return stats["acc"]

    def observe(self, layer: int, p_old: Tensor, p_new: Tensor) -> None:
        self.score[layer] += reduce_heads(p_old, self.head_agg)
