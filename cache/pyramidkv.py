"""PyramidKV (Cai et al., 2024): SnapKV selection with budgets shrinking from bottom to top.

The per-layer budgets follow the paper's arithmetic schedule (beta = 20) over what is left
after the window (alpha = 8 tokens, kept in every layer), and sum exactly to
n_layers * budget (largest-remainder rounding; the reference code's integer steps overshoot).
Each layer allocates only its own capacity.
"""
from cache.base import pyramid_budgets
from cache.snapkv import SnapKVPolicy


class PyramidKVPolicy(SnapKVPolicy):
    name = "pyramidkv"
    params = {**SnapKVPolicy.params,
              "window": (int, 8, "observation window (the paper's alpha), kept in every layer"),
              "beta": (float, 20.0, "top layer gets (budget - window) / beta")}

    def validate(self) -> None:
        super().validate()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def setup(self, args, max_batch_size, max_seq_length, dtype, device) -> None:
        self.budgets = pyramid_budgets(args.n_layers, self.budget, self.window, self.beta)
        super().setup(args, max_batch_size, max_seq_length, dtype, device)

    def layer_budget(self, layer: int) -> int:
        return self.budgets[layer]

    def describe(self) -> dict:
        return {**super().describe(), "layer_budgets": getattr(self, "budgets", None)}
