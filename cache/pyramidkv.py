"""PyramidKV (Cai et al., 2024): SnapKV selection with budgets shrinking from bottom to top.

The per-layer budgets follow the paper's arithmetic schedule (pyramid_beta = beta = 20) over what
is left after the observation window (obs_window = alpha = 8 tokens, kept in every layer), and sum exactly to
n_layers * budget (largest-remainder rounding; the reference code's integer steps overshoot).
Each layer allocates only its own capacity.
"""
from cache.base import pyramid_budgets
from cache.snapkv import SnapKVPolicy


class PyramidKVPolicy(SnapKVPolicy):
    name = "pyramidkv"
    params = {**SnapKVPolicy.params,
              "obs_window": (int, 8, "observation window (the paper's alpha), kept in every layer"),
              "pyramid_beta": (float, 20.0, "the paper's beta: the top layer gets (budget - obs_window) / pyramid_beta")}
    renamed = {"window": "obs_window", "beta": "pyramid_beta"}

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        """A budget whose smallest (top) layer still holds every token: obs_window + pyramid_beta (n - obs_window)."""
        w, beta = cls.params["obs_window"][1], cls.params["pyramid_beta"][1]
        return {"budget": w + int(beta * max(n_tokens - w, 1)) + 1}

    def validate(self) -> None:
        super().validate()
        if self.pyramid_beta < 1:
            raise ValueError(f"pyramid_beta must be >= 1, got {self.pyramid_beta}")

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        self.budgets = pyramid_budgets(args.n_layers, self.budget, self.obs_window, self.pyramid_beta)
        super().setup(args, max_batch_size, max_seq_length, dtype, device)

    def layer_budget(self, layer: int) -> int:
        return self.budgets[layer]

    def describe(self) -> dict:
        return {**super().describe(), "layer_budgets": getattr(self, "budgets", None)}
