"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus sinks and a recent window.

Per layer and KV head the cache holds `budget` tokens: the first `n_sink`, the `n_recent` most
recent, and the heavy hitters: the tokens with the largest accumulated attention (column sums
of the prompt's attention, then every decode step's attention added; GQA: mean over the query
heads of a KV head).  Eviction happens during decode too, one slot per step: the step attends
over the cache plus the new token, adds the probabilities, and the unprotected slot with the
lowest accumulated score makes room for the new token.  The budget never grows.
"""
from torch import Tensor

from cache.base import ALWAYS, HEAD_AGG_PARAM, NEVER, EvictionPolicy, column_scores, recent_and_sinks, reduce_heads


class H2OPolicy(EvictionPolicy):
    name = "h2o"
    params = {**EvictionPolicy.params, **HEAD_AGG_PARAM,
              "n_sink": (int, 4, "first tokens always kept"),
              "n_recent": (int, -1, "recent tokens always kept (-1: half of budget - n_sink, the "
                                  "paper's equal heavy/recent split)")}
    renamed = {"window": "n_recent"}
    decode_attention = True

    def validate(self) -> None:
        super().validate()
        if self.n_recent == -1:
            self.n_recent = max(1, (self.budget - self.n_sink) // 2)
        if self.n_sink < 0 or self.n_recent < 1 or self.budget < self.n_sink + self.n_recent:
            raise ValueError(f"budget ({self.budget}) must be at least n_sink ({self.n_sink}) + "
                             f"n_recent ({self.n_recent}), with n_recent >= 1")

    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor) -> dict:
        return {"acc": column_scores(q, k, q_pos, None, self.sliding_window, agg=self.head_agg)}

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        always = recent_and_sinks(q_pos, self.n_sink, self.n_recent)[:, None, :]
        return stats["acc"].masked_fill(always, ALWAYS).masked_fill((q_pos < 0)[:, None, :], NEVER)

    def observe(self, layer: int, p_old: Tensor, p_new: Tensor) -> None:
        self.score[layer] += reduce_heads(p_old, self.head_agg)

    def decode_victim(self, layer: int) -> Tensor:
        return self.lowest(layer, self.score[layer], self.protected(layer, self.n_sink, self.n_recent))
