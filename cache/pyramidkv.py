"""PyramidKV (Cai et al., 2024): SnapKV selection with budgets shrinking from bottom to top.

The per-layer budgets follow the paper's arithmetic schedule (pyramid_beta = beta = 20) over what
is left after the observation window (obs_window = alpha = 8 tokens, kept in every layer), and sum exactly to
n_layers * budget (largest-remainder rounding; the reference code's integer steps overshoot).
When a layer's budget exceeds the prompt (it can hold no more than the prompt), its surplus goes to
the other layers in proportion to their budgets (`fill_to_cap`), so the total kept is
min(n_layers * budget, n_layers * prompt length), the reference code's total too (it switches to
uniform budgets for short prompts instead: docs/policies.md).  Each layer allocates only its own
capacity, fixed when the prompt arrives.  Each row of a batch gets its own schedule, from its own token
budget (`ratio=`: from its prompt length) and capped at its own prompt length; a layer allocates the
largest row's.
"""
from dataclasses import dataclass

from cache.params import param, policy_params
from cache.scoring import fill_to_cap, pyramid_budgets
from cache.snapkv import SnapKVPolicy


@dataclass(eq=False)
class PyramidKVPolicy(SnapKVPolicy):
    admission = "batch"     # layer budgets follow the prompt length (fill_to_cap): storage is the batch's
    name = "pyramidkv"
    obs_window: int = param(8, "observation window (the paper's alpha), kept in every layer")
    pyramid_beta: float = param(20.0, "the paper's beta: the top layer gets (budget - obs_window) / pyramid_beta")
    renamed = {"window": "obs_window", "beta": "pyramid_beta"}

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        """A budget whose smallest (top) layer still holds every token: obs_window + pyramid_beta (n - obs_window)."""
        w, beta = policy_params(cls)["obs_window"][1], policy_params(cls)["pyramid_beta"][1]
        return {"budget": w + int(beta * max(n_tokens - w, 1)) + 1}

    def validate(self) -> None:
        super().validate()
        if self.pyramid_beta < 1:
            raise ValueError(f"pyramid_beta must be >= 1, got {self.pyramid_beta}")

    def layer_budgets(self, budget: int, length: int) -> list[int]:
        """The pyramid schedule of `budget`, capped at the row's prompt `length` (surplus to the other layers)."""
        return fill_to_cap(pyramid_budgets(self.args.n_layers, budget, self.obs_window, self.pyramid_beta), length)

    def describe(self) -> dict:
        return {**super().describe(), "layer_budgets": self.budgets}
