"""Per-row admission of the eviction family (a mixin of EvictionPolicy, cache/base.py, whose state it reads):
each row's budgets from its own prompt (`plan_rows`), rows that join and leave a running batch (`release`,
`adopt`), and a question held whole after a compressed context.

A question appended after a compressed context (the agnostic protocol, `hold_question`) is held whole:
while a row appends it, an evicting layer never picks its tokens as victims (they count as protected,
like the sinks and the recent window), so the victims come from the context; from the row's first
answer token on they are ordinary tokens again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class RowAdmission:
    """EvictionPolicy's row methods (host side, except `held`, read in the decode step)."""

    def plan_rows(self) -> None:
        """Host side, once the layers' plans are known (before `allocate`): each row's token budget from its
        prompt length (`resolve_budget`), its per-layer budgets (`layer_budgets`) and recent windows, and the
        budget each layer's storage holds: the largest row's (fixed storage: the bound fixed at setup)."""
        rows = ([self.layer_budgets(self.resolve_budget(n), n) for n in self.lengths] if self.budgeted else
                [[self.layer_budget(layer) for layer in range(len(self.k))]] * len(self.lengths))
        if self.budgeted:
            self.row_tokens = [self.resolve_budget(n) for n in self.lengths]
            if not self.fixed_storage:
                self.budgets = [max(column) for column in zip(*rows)]
        windows = [[self.recent_window(layer, b) for layer, b in enumerate(row)] for row in rows]
        self.row_budget.copy_(torch.tensor(rows))
        self.row_window.copy_(torch.tensor(windows))

    def row_tensors(self, layer: int, row: int) -> list[Tensor]:
        """Row `row` of what layer `layer` holds: slot table, slot scores, K/V (its format's)."""
        kept = [self.pos[layer][row]] + ([self.score[layer][row]] if self.score[layer] is not None else [])
        return kept + self.slots.row(layer, row)

    def release(self, row: int) -> None:
        """Forget row `row`'s request (host side): its slots become empty; the other rows go on."""
        for pos in self.pos:
            pos[row] = -1
        self.row_question[row] = 0
        self.row_now[row] = -1
        self.row_tokens[row] = None
        self.aligned = False
        self.n_filled = max(int(pos.amax()) + 1 for pos in self.pos)     # the longest row's tokens

    def adopt(self, row: int, other: "EvictionPolicy", other_row: int = 0) -> None:
        """Take over request `other_row` of `other` (this policy's spec, set up with the same decode_room
        and max_seq_length but its own batch size, its prompt complete) into row `row` (host side)."""
        if self.admission != "row":
            raise ValueError(f"{self.name} admits whole batches (admission 'batch'): rows cannot join a running batch")
        if self.decode_room is None or other.decode_room != self.decode_room:
            raise ValueError("rows join a running batch only with the same decode_room set before setup")
        self.release(row)
        for layer in range(len(self.pos)):
            for dst, src in zip(self.row_tensors(layer, row), other.row_tensors(layer, other_row)):
                dst.copy_(src)
        self.row_budget[row], self.row_window[row] = other.row_budget[other_row], other.row_window[other_row]
        self.row_tokens[row] = other.row_tokens[other_row]
        self.row_now[row] = other.q_pos[other_row].amax() if other.q_pos is not None else other.row_now[other_row]
        self.n_filled = max(self.n_filled, other.n_filled)
        self.prompt_length = max(self.prompt_length, other.prompt_length)
        self.kept = [max(a, b) for a, b in zip(self.kept, other.kept)]      # what describe() reports

    def question_room(self, row: int) -> Optional[int]:
        """The longest question row `row` can hold whole (`hold_question`): in each evicting layer its budget
        less the sinks (so a victim is left outside the sinks and the question); None when no layer evicts."""
        budgets = [int(self.row_budget[row, layer]) if self.budgeted else self.layer_budget(layer)
                   for layer, appends in enumerate(self.layer_appends) if not appends]
        return min(budgets) - self.n_sink if budgets else None

    def hold_question(self, row: int, start: int, end: int) -> None:
        """Host side (the agnostic protocol): positions [start, end) of row `row`, a question appended one decode
        step each after its context, are never an evicting layer's victims while the row's position is below
        `end` (`held`): all of them are held when its first answer token is sampled; after that they are
        ordinary tokens.  release, adopt and reset forget it.  ValueError when the question cannot be held
        whole (longer than question_room)."""
        room = self.question_room(row)
        if not 0 <= start < end:
            raise ValueError(f"a held question needs 0 <= start < end, got [{start}, {end})")
        if room is not None and end - start > room:
            raise ValueError(f"{self.name}: a question of {end - start} tokens cannot be held whole: an evicting "
                             f"layer keeps {room + self.n_sink} tokens per KV head, {self.n_sink} of them sinks")
        self.row_question[row, 0], self.row_question[row, 1] = start, end

    def held(self, layer: int) -> Tensor:
        """Slots [B, H, C] holding a question that is still being appended (hold_question)."""
        start, end = self.row_question[:, 0, None, None], self.row_question[:, 1, None, None]
        pos = self.pos[layer]
        return (pos >= start) & (pos < end) & (self.q_pos[:, None, :] < end)
