"""The one-method tier of the eviction family (kvpress's ScorerPress): score every token from its own K/V,
keep the top budget.

At prefill each layer and KV head keeps the `budget` prompt tokens of highest `token_scores` (or, with
`ratio`, int(n * (1 - ratio)) of a prompt of n tokens), plus the first `n_sink` and the last `n_recent`
always; at every decode step the new token is stored with its score and the kept token of lowest score
outside the sinks and the recent window leaves, so memory stays flat (`decode_evict=false`: compress at
prefill only and append decode tokens).  A policy on this tier writes its `name`, its parameter fields
(n_sink, n_recent with its defaults: sink_param, recent_param) and `token_scores`; `validate` checks
every shared field.  docs/adding-a-policy.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from cache.base import EvictionPolicy
from cache.params import Budget, DecodeEviction


@dataclass(eq=False)
class ScoredEviction(DecodeEviction, Budget, EvictionPolicy):
    """Base of the policies whose rule is a token score: keep_scores, decode_victim and observe are the
    base's defaults (the kept set is the top budget of `token_scores`, sinks and recent window included)."""

    def validate(self) -> None:
        """The shared fields: n_sink, n_recent >= 0, decode_evict a bool, head_agg, and budget >= min_budget()
        (budget or ratio, ratio in (0, 1): check_budget, before this)."""
        for name in ("n_sink", "n_recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.decode_evict, bool):
            raise ValueError(f"decode_evict must be true or false, got {self.decode_evict!r}")
        super().validate()
