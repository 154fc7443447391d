"""SnapKV (Li et al., 2024): the prompt's last `obs_window` queries vote for the keys to keep.

Scores: softmax in fp32 of the window queries over all keys, summed over the window queries,
averaged over the query heads of each KV head, then 1-D pooled (max, kernel 7) over the past
tokens.  Per KV head the cache keeps the top (budget - obs_window) past tokens plus the window.
Generated tokens are appended (the cache grows by one slot per step; nothing is evicted).
"""
import torch
from torch import Tensor

from dataclasses import dataclass

from cache.base import EvictionPolicy
from cache.params import Budget, HeadAgg, param
from cache.scoring import column_scores, pool1d


@dataclass(eq=False)
class SnapKVPolicy(HeadAgg, Budget, EvictionPolicy):
    name = "snapkv"
    obs_window: int = param(32, "observation window w: the last prompt queries, always kept")
    kernel: int = param(7, "pooling kernel (odd; 1 = no pooling)")
    pooling: str = param("max", "pooling kind: max or avg")
    renamed = {"window": "obs_window"}
    appending = True

    def validate(self) -> None:
        if self.obs_window < 1 or (self.budget is not None and self.budget < self.min_budget()):
            raise ValueError(f"budget ({self.budget}) must be at least the obs_window ({self.obs_window}), obs_window >= 1")
        super().validate()
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd and positive, got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling must be max or avg, got {self.pooling!r}")

    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        return {"obs": column_scores(q, k, q_pos, self.obs_window, self.sliding_window, agg=self.head_agg, k_pos=k_pos)}

    def prefill_queries(self) -> int:
        return self.obs_window

    def min_budget(self) -> int:
        return max(1, self.obs_window)

    def recent_window(self, layer: int, budget: int) -> int:
        return self.obs_window      # kept at prefill; appending layers never evict, so a prefill-only window

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        obs = stats["obs"]
        T = obs.shape[-1]
        # pool over the past only: the last `obs_window` columns (left padding ends every row at column T - 1)
        return pool1d(obs, self.kernel, self.pooling, within=torch.arange(T, device=obs.device) < T - self.obs_window)
