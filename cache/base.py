"""Shared mechanics of the policies that keep a subset of tokens (the eviction family).

Storage per layer l (capacity C_l slots, allocated when the prompt arrives, never in decode):
    k, v   [B, H_kv, C_l, D]  keys (rotated at their absolute position) and values, held by the
                              policy's K/V format object `slots` (cache/slots.py's DenseSlots: the compute dtype;
                              cache/quantized.py's KIVISlots: KIVI-packed, chosen by --kv-bits)
    pos    [B, H_kv, C_l]     absolute position held by each slot, -1 = empty
    score  [B, H_kv, C_l]     fp32 keep score per slot, in evicting layers (and with decode_attention):
                              accumulated attention (H2O, D2O) or the policy's `token_scores`
Each KV head keeps its own tokens.  Policies read and write K/V only through the K/V-format delegates
(`write_kept`, `write_slots`, `read_slots`, `key_cosine`, `attend_and_probs`, `attend`, `dense_kv`).
The contract: cache/contract.py.

Prefill: attention over the prompt is full and causal (so the first generated token equals the full
cache's).  The policy's `prefill_stats` summarises what it needs from the layer (e.g. window scores);
then `compress` keeps the top `layer_budget` of `keep_scores` per KV head (by default the tokens' own
`token_scores`), the first `n_sink` and the last `recent_window` tokens always.  Policies whose per-layer budgets
depend on every layer (D2O, SimLayerKV) set `defer_compression`: the prompt's K/V wait in
`pending` until `end_prefill`, where `plan` fixes the budgets on the host.

The prompt comes in one pass (engine.generate, the evals), or in chunks, *staged* (cache/staging.py), when
the instance holds rows that join a running batch (decode_room set; `prefill_in_one_pass`): the keep
decision then runs once, at `end_prefill`, on the whole prompt, exactly as in one pass.

Decode, per layer, without host syncs: an *appending* layer (SnapKV, PyramidKV, SimLayerKV's
full layers) writes the new token into the next empty slot (capacity = kept prompt tokens +
room for every generated token); an *evicting* layer (StreamingLLM, H2O, D2O, lazy layers)
overwrites the slot `decode_victim` names (by default the unprotected slot of lowest `score`;
the sinks and the recent window are protected), so its size never grows.  Attention reads the C_l
slots (empty ones masked): the cost follows what is kept, never max_seq_length.
A question appended after a compressed context (`hold_question`, cache/rows.py) is held whole: an evicting
layer takes no victim among its tokens while the row appends it.
Policies that need the step's attention probabilities (H2O, D2O) attend over the old slots plus
the new token with one joint softmax (`attend_with_new`) before choosing the victim, exactly as
if the cache briefly held C_l + 1 tokens, without copying it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from cache.params import DEFAULT_BUDGET, HEAD_AGG, param_values, policy_params
from cache.rows import RowAdmission
from cache.scoring import ALWAYS, NEVER, first_min, recent_and_sinks, reduce_heads, select_top
from cache.slots import DenseSlots
from cache.staging import ChunkStaging
from model import ModelArgs, attention_mask, grouped_attention


@dataclass(eq=False)
class EvictionPolicy(RowAdmission, ChunkStaging):
    """Base class.  A policy is a dataclass whose fields are its parameters (cache/params.py; groups:
    Budget, HeadAgg, sink_param/recent_param) and either scores each token by its own K/V
    (`token_scores`: prefill and decode) or overrides `keep_scores` (which prompt tokens to keep) and,
    for evicting layers, `decode_victim` or `observe`.  The first `n_sink` and the last
    `recent_window(layer)` tokens are always kept.  Optional hooks: `prefill_stats`,
    `plan` (with defer_compression), `layer_budget`, `on_evict`, `on_compress`.  docs/adding-a-policy.md."""

    name = "eviction"
    renamed = {}                   # old parameter name -> new one (refused with a message naming it)
    budget = None                  # tokens kept per layer and KV head (the Budget parameter; None: no budget)
    ratio = None                   # or the share of each prompt removed (the Budget parameter)
    is_sparse_reader = False
    storage_kind = "slots"         # per-layer slot tables; their K/V format is `slots` (cache/contract.py)
    static_decode = True           # a decode step reads no host count (static_tensors; cache/contract.py)
    decode_attention = False       # decode needs the step's attention probabilities
    head_agg = "mean"              # how the query heads of a KV head score a token (the HeadAgg parameter)
    head_aggs = HEAD_AGG           # the values head_agg may take
    defer_compression = False      # budgets need every layer's statistics (see module doc)
    appending = False              # default layer mode: append decode tokens instead of evicting
    decode_evict = True            # False: every layer appends (the DecodeEviction parameter)
    admission = "row"              # requests join and leave single rows (per-request plans: "batch")
    prefix_reuse = False           # the prompt is compressed as a whole: no prefix to continue
    decode_room = None             # generated tokens a row holds (None: up to max_seq_length; see capacity)
    n_sink, n_recent = 0, 0        # tokens always kept: the first n_sink, the last recent_window(layer)
    prompt_length = 0              # set per request (before_prefill); 0 before setup
    n_filled = 0                   # tokens seen so far (prompt + generated), a host int
    row_tokens = ()                # per row, the token budget its prompt resolved to (None: no request); set up
    budgets = None                 # per layer, the budget its storage holds (budgeted policies; set up)
    staged = None                  # per layer, a prompt coming in chunks: its K/V, window queries, statistics

    @property
    def prefill_in_one_pass(self) -> bool:
        """An instance holding rows that join a running batch (decode_room set) takes its prompt in chunks,
        staged (module doc); otherwise (engine.generate's batch) in one pass, where staging would hold the
        whole batch's prompts uncompressed beside the cache."""
        return self.decode_room is None

    @classmethod
    def full_cache_args(cls, n_tokens: int):
        """A budget of every token keeps them all (policies with more rules override)."""
        return {"budget": n_tokens}

    @property
    def reader_composable(self) -> bool:
        """A sparse reader may replace decode attention: not when decode needs the attention itself, nor
        over per-query-head storage (readers read KV heads)."""
        return not self.decode_attention and self.head_agg != "query"

    def __post_init__(self):
        self.slots = DenseSlots()       # K/V format (with_kv_bits: KIVISlots)
        if "budget" in policy_params(type(self)):
            self.check_budget()
        self.validate()

    def check_budget(self) -> None:
        """The Budget parameters: budget or ratio, not both (neither: budget=DEFAULT_BUDGET)."""
        if self.budget is not None and self.ratio is not None:
            raise ValueError(f"give budget ({self.budget}) or ratio ({self.ratio}), not both")
        if self.ratio is None and self.budget is None:
            self.budget = DEFAULT_BUDGET
        if self.ratio is not None and not 0 < self.ratio < 1:
            raise ValueError(f"ratio must be in (0, 1) (the share of the prompt removed), got {self.ratio}")

    @property
    def budgeted(self) -> bool:
        """The policy keeps a token budget (budget or ratio): each row keeps its own (plan_rows)."""
        return self.budget is not None or self.ratio is not None

    def validate(self) -> None:
        if self.head_agg not in self.head_aggs:
            raise ValueError(f"head_agg must be one of {', '.join(self.head_aggs)}, got {self.head_agg!r}")
        if not self.budgeted:
            return
        if self.n_sink < 0:
            raise ValueError(f"n_sink must not be negative, got {self.n_sink}")
        if self.budget is not None and self.budget < self.min_budget():
            raise ValueError(f"budget ({self.budget}) must be at least n_sink ({self.n_sink}) + n_recent "
                             f"({self.n_recent}), and positive")

    def min_budget(self) -> int:
        """The smallest budget the other parameters allow (a ratio's budget never goes below it)."""
        return max(1, self.n_sink + self.n_recent)

    def resolve_budget(self, n_tokens: int) -> int:
        """Tokens per layer and KV head a prompt of n_tokens keeps: `budget`, or with `ratio` kvpress's
        n_kept = int(n_tokens * (1 - ratio)) (ScorerPress), raised to min_budget() if below it."""
        if self.ratio is None:
            return self.budget
        return max(int(n_tokens * (1 - self.ratio)), self.min_budget())

    # ----------------------------------------------------------------- policy hooks
    def layer_budget(self, layer: int) -> int:
        """Prompt tokens layer `layer` keeps per KV head (its budget; rows with their own: the largest, or
        with fixed storage the bound fixed at setup; see plan_rows)."""
        return self.budgets[layer]

    def layer_budgets(self, budget: int, length: int) -> list[int]:
        """Per layer, the prompt tokens a row keeps per KV head when its token budget is `budget` and its prompt
        `length` tokens long.  Default: `budget` in every layer (PyramidKV and D2O: their schedules)."""
        return [budget] * self.args.n_layers

    def prefill_stats(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
        """What the policy needs from this layer's prompt attention (tensors): queries q [B, H_q, T, D] at
        q_pos [B, T] over the keys k [B, H_kv, L, D] at k_pos [B, L] (in one pass the same tokens; see
        `prefill_queries` for which queries a staged prompt passes)."""
        return {}

    def prefill_queries(self) -> Optional[int]:
        """Which prompt queries `prefill_stats` reads: the last n (0: none), or None: every query, and then each
        of its statistics is a sum over the queries of a tensor [..., L] over the keys (it adds up over chunks)."""
        return 0

    def plan(self, stats: list[dict]) -> None:
        """Host-side, with defer_compression: fix per-layer budgets/modes from all layers."""

    def recent_window(self, layer: int, budget: int) -> int:
        """Most recent tokens layer `layer` always keeps, at prefill and in decode (with the first n_sink), in a
        row whose budget in that layer is `budget`."""
        return self.n_recent

    def token_scores(self, layer: int, k: Tensor, v: Tensor, pos: Tensor) -> Tensor:
        """Keep priority [B, H_kv, T] (higher = keep) of tokens from their own k, v [B, H_kv, T, D] (as stored)
        at positions pos [B, H_kv, T]: the prompt's at prefill (keep_scores' default), each new token's in
        decode (written to its slot's `score`; decode_victim's default evicts the lowest).  Default: the
        position, so the newest tokens stay (StreamingLLM)."""
        return pos.float()

    def keep_scores(self, layer: int, stats: dict, q_pos: Tensor, n_heads: int) -> Tensor:
        """Keep priority [B, H_kv, T] of the prompt tokens (-inf: never keep); `compress` then keeps the
        sinks and the recent window whatever their score, and never padding.  Default: stats["token"],
        the prompt's token_scores.  The kept tokens' values start their slots' `score`."""
        return stats["token"]

    def decode_victim(self, layer: int) -> Tensor:
        """Slot [B, H_kv] an evicting layer overwrites: an empty slot while there is one, else the slot of
        lowest `score` outside the first n_sink and the recent window."""
        window = self.row_window[:, layer, None, None]          # each row's
        return self.lowest(layer, self.score[layer], self.protected(layer, self.n_sink, window))

    def observe(self, layer: int, p_old: Tensor, p_new: Tensor) -> None:
        """Decode attention probabilities (decode_attention policies): [B, H_kv, G, C], [.., 1]."""

    def on_evict(self, layer: int, slot: Tensor) -> None:
        """Called before the new token overwrites `slot` [B, H_kv] (D2O merges it away)."""

    def on_compress(self, layer: int, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor, stats: dict,
                    kc: Tensor, vc: Tensor) -> None:
        """Called when a layer keeps prompt tokens idx [B, H_kv, n]: kc, vc [B, H_kv, n, D] are the kept
        keys/values (full precision), stored after this hook; D2O merges the others into them in place."""

    # ----------------------------------------------------------------- contract
    def prepare(self, model, tokenizer) -> None:
        """Host side, before the first setup: make missing per-checkpoint side data (none here)."""

    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype, device) -> None:
        self.args = args
        self.batch, self.dtype, self.device = max_batch_size, dtype, device
        self.group = args.n_heads // args.n_kv_heads
        # head_agg=query stores a copy of each KV head per query head (G x the K/V memory) so that every
        # query head keeps its own tokens; attention then reads storage head h with query head h
        self.store_heads = args.n_heads if self.head_agg == "query" else args.n_kv_heads
        self.store_group = args.n_heads // self.store_heads
        self.sliding_window = args.sliding_window
        self.max_seq_length = max_seq_length
        n = args.n_layers
        self.slots.setup(n, max_batch_size, self.store_heads, args.head_dim, dtype, device)
        self.pos: list = [None] * n
        self.score: list = [None] * n
        self.kept = [0] * n                   # prompt tokens kept per layer (host ints)
        self.layer_appends = [self.appending or not self.decode_evict] * n
        # each row's budget per layer [B, L] (an evicting layer's slots past it stay closed to that row) and
        # recent window [B, L], and its token budget (row_tokens, host ints): set per request by plan_rows
        self.row_budget = torch.zeros(max_batch_size, n, dtype=torch.long, device=device)
        self.row_window = torch.zeros(max_batch_size, n, dtype=torch.long, device=device)
        # each row's held question [B, 2]: positions [start, end) protected while the row is before `end`
        # (hold_question; 0, 0: none)
        self.row_question = torch.zeros(max_batch_size, 2, dtype=torch.long, device=device)
        # each adopted row's newest position [B] (-1: none): packed slots' `now` between adopt and the batch's
        # next forward, when q_pos is not yet the batch's (kv_store)
        self.row_now = torch.full((max_batch_size,), -1, dtype=torch.long, device=device)
        # per layer, the budget storage holds: until a prompt arrives, that of a max_seq_length-token prompt
        # (with a ratio the largest any prompt gets: the bound of fixed storage)
        if self.budgeted:
            self.budgets = self.layer_budgets(self.resolve_budget(max_seq_length), max_seq_length)
        # rows that join a running batch: storage allocated once here (at the bound above), reused by every request
        self.fixed_storage = self.decode_room is not None and self.admission == "row"
        if self.fixed_storage:
            for layer in range(n):
                self.allocate_layer(layer)
        self.reset()

    def reset(self) -> None:
        for p in self.pos:
            if p is not None:
                p.fill_(-1)
        self.row_question.zero_()
        self.row_now.fill_(-1)
        self.aligned = True     # every row holds a request that started with the others (else: adopt)
        self.row_tokens = [None] * self.batch
        self.n_filled = 0       # tokens seen so far (prompt + generated), a host int
        self.prompt_length = 0
        self.q_pos = None
        self.pending: dict = {}
        self.prepared = False   # before_prefill ran for this request
        self.staged = None      # a staged prompt's K/V, window queries and statistics (start_staging)

    def before_prefill(self, input_pos: Tensor) -> None:
        """Host side, before the prompt's first forward (input_pos [B, T], the whole prompt):
        validate, fix what the prompt keeps per layer and allocate those layers' storage.
        Done here rather than inside the (possibly compiled) prefill, so the graph never
        depends on the prompt length or max_seq_length through Python ints."""
        B, T = input_pos.shape
        if self.n_filled:
            raise ValueError(f"policy {self.name!r} takes the prompt in one pass; got a second chunk")
        if B != self.batch:
            raise ValueError(f"batch {B} does not match the cache's batch {self.batch}")
        if T > self.max_seq_length:
            raise ValueError(f"prompt of {T} tokens exceeds max_seq_length {self.max_seq_length}")
        self.prompt_length = T
        self.prompt_pos = input_pos
        self.lengths = (input_pos.amax(-1) + 1).tolist()    # each row's prompt length (one host sync)
        self.prepared = True
        if not self.defer_compression:
            self.plan_rows()
            for layer in range(len(self.k)):
                self.allocate(layer)


    def begin(self, input_pos: Tensor, n_filled: Optional[int] = None) -> None:
        if n_filled is not None:
            self.n_filled = n_filled
        B, T = input_pos.shape
        if self.pending:            # the prompt went through model(...) directly: finish it
            self.end_prefill()
        if not self.n_filled and not self.prepared:     # model(...) called without the engine
            self.before_prefill(input_pos)
        if not self.n_filled and not self.prefill_in_one_pass and T < self.prompt_length:
            self.start_staging()                        # the first of several chunks
        if not torch.compiler.is_compiling():           # the engine checks these on the host
            self.check_chunk(T)
        self.q_pos = input_pos
        if self.staged is not None:                     # this chunk over everything staged so far
            self.chunk_start = self.n_filled
            self.mask = attention_mask(input_pos, self.prompt_pos[:, :self.n_filled + T], self.group,
                                       self.sliding_window)
        elif not self.n_filled:
            self.mask = attention_mask(input_pos, input_pos, self.group, self.sliding_window)
        self.n_filled += T

    def check_chunk(self, T: int) -> None:
        """ValueError for a forward of T tokens the cache cannot take now (host side)."""
        if self.staged is not None:
            if self.n_filled + T > self.prompt_length:
                raise ValueError(f"prompt chunk ends at {self.n_filled + T}, past the prompt's "
                                 f"{self.prompt_length} tokens")
            if T == 1 and self.n_filled:
                raise ValueError("a later prompt chunk of one token would run as a decode step (model.forward): "
                                 "chunks after the first need at least 2 tokens (runtime.steps.chunk_end)")
        elif not self.n_filled and T < self.prompt_length:
            raise ValueError(f"policy {self.name!r} takes the prompt in one pass here (prefill_in_one_pass): got "
                             f"{T} of its {self.prompt_length} tokens")
        elif self.n_filled and T > 1:
            raise ValueError(f"policy {self.name!r} has its whole prompt already; got a second chunk")
        if self.n_filled >= self.max_seq_length:
            raise ValueError(f"KV cache full: position {self.n_filled} >= max_seq_length {self.max_seq_length}")

    def before_decode_step(self, step: int) -> None:
        pass

    # ----------------------------------------------------------------- the static decode step
    def begin_static_step(self) -> int:
        """Host side, before a static decode step: what `begin` does on the host for a decode token (a prompt that
        went through model(...) directly is compressed, the room checked, n_filled advanced) -> 0: every layer's
        storage has a fixed capacity and its decode reads all of it (empty slots masked), so no bound is needed."""
        if self.pending:
            self.end_prefill()
        self.check_chunk(1)
        self.n_filled += 1
        return 0

    def begin_static(self, input_pos: Tensor, n_read: int) -> None:
        """A static decode step's begin (input_pos [B, 1]): the positions are the step's only new input."""
        self.q_pos = input_pos

    def static_tensors(self) -> list[Tensor]:
        """Every buffer a decode step reads or writes in place (a CUDA graph keeps their addresses): the K/V
        format's, the slot tables and scores, each row's budgets, window, question and newest position."""
        tables = [t for t in self.pos + self.score if t is not None]
        return self.slots.static_tensors() + tables + [self.row_budget, self.row_window, self.row_question,
                                                       self.row_now]

    def capacity(self, layer: int) -> int:
        """Slots layer `layer` allocates: its budget, plus room for every generated token when
        it appends (an evicting layer holds its budget): decode_room tokens, or, without one, up to
        max_seq_length after this prompt.  Slots the prompt leaves empty (budget > prompt) stay empty
        until decode fills them."""
        budget = self.layer_budget(layer)
        room = self.max_seq_length - self.prompt_length if self.decode_room is None else self.decode_room
        return budget + room if self.layer_appends[layer] else budget

    def allocate(self, layer: int) -> None:
        """Fix what the prompt keeps in layer `layer` and allocate its storage (host side, once the prompt
        length is known; storage fixed at setup is reused)."""
        self.kept[layer] = min(self.layer_budget(layer), self.prompt_length)
        if not self.fixed_storage:
            self.allocate_layer(layer)

    def allocate_layer(self, layer: int) -> None:
        B, H, cap = self.batch, self.store_heads, self.capacity(layer)
        self.slots.allocate(layer, cap)
        self.pos[layer] = torch.full((B, H, cap), -1, dtype=torch.long, device=self.device)
        scored = self.decode_attention or not self.layer_appends[layer]     # slots an eviction chooses among
        self.score[layer] = torch.zeros(B, H, cap, dtype=torch.float32, device=self.device) if scored else None

    def used_slots(self, layer: int) -> int:
        """Slots any sequence may have filled so far (empty slots fill lowest index first; rows that
        joined a running batch: counted from the slot table, a host sync)."""
        if not self.aligned:
            filled = (self.pos[layer] >= 0).any(0).any(0).nonzero()
            return int(filled[-1]) + 1 if len(filled) else 0
        return min(self.pos[layer].shape[2], self.kept[layer] + self.n_filled - self.prompt_length)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.staged is not None:
            return self.prefill_staged(layer, q, k, v)
        out = grouped_attention(q, k, v, self.mask)
        stats = self.prefill_stats(layer, q, k, self.q_pos, self.q_pos)
        if self.defer_compression:
            self.pending[layer] = (k, v, stats)
        else:
            self.compress(layer, k, v, stats)
        return out

    def end_prefill(self) -> None:
        if not self.pending:
            return
        if self.staged is not None:         # the staged prompt is complete: compress it as one pass would
            self.q_pos, self.staged = self.prompt_pos, None
        if self.defer_compression:
            self.plan([self.pending[i][2] for i in range(len(self.k))])
            self.plan_rows()
        for layer in range(len(self.k)):
            if self.defer_compression:
                self.allocate(layer)
            self.compress(layer, *self.pending.pop(layer))

    def compress(self, layer: int, k: Tensor, v: Tensor, stats: dict) -> None:
        """Keep the prompt tokens with the best keep_scores, the sinks and the recent window in the layer's
        storage (its first layer_budget slots; those without a keepable token stay empty)."""
        k, v = self.to_store(k), self.to_store(v)
        H, D = k.shape[1], k.shape[3]
        pos = self.q_pos[:, None, :].expand(-1, H, -1)
        scores = self.keep_scores(layer, {**stats, "token": self.token_scores(layer, k, v, pos)}, self.q_pos, H)
        always = recent_and_sinks(self.q_pos, self.n_sink, self.row_window[:, layer, None])[:, None, :]
        ranked = scores.masked_fill(always, ALWAYS).masked_fill((self.q_pos < 0)[:, None, :], NEVER)
        idx, valid = select_top(ranked, self.layer_budget(layer), self.row_budget[:, layer] if self.budgeted else None)
        n = idx.shape[-1]
        gather = idx[..., None].expand(-1, -1, -1, D)
        kc, vc = k.gather(2, gather), v.gather(2, gather)
        self.pos[layer][:, :, :n] = torch.where(valid, pos.gather(2, idx), -1)
        if self.score[layer] is not None:
            self.score[layer][:, :, :n] = scores.gather(2, idx)
        self.on_compress(layer, k, v, idx, valid, stats, kc, vc)
        self.write_kept(layer, kc, vc)

    def to_store(self, x: Tensor) -> Tensor:
        """K or V [B, H_kv, T, D] as stored: repeated per query head under head_agg=query."""
        return x if x.shape[1] == self.store_heads else x.repeat_interleave(self.store_heads // x.shape[1], 1)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k, v = self.to_store(k), self.to_store(v)
        if self.decode_attention and not self.layer_appends[layer]:
            out, p_old, p_new = self.attend_and_probs(layer, q, k, v)
            self.observe(layer, p_old, p_new)
            slot = self.store(layer, k, v)
            self.score[layer].scatter_(2, slot[:, :, None], reduce_heads(p_new, self.head_agg))
            return out
        self.store(layer, k, v)
        return self.attend(layer, q)

    def store(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """Write the new token k, v [B, H_kv, 1, D] into its slot (and, in an evicting layer, its
        token_scores into the slot's score: decode_attention policies score it in `decode`); returns the
        slot [B, H_kv].  Readers call this, not `decode`."""
        pc = self.pos[layer]
        evicts = not self.layer_appends[layer]
        slot = self.decode_victim(layer) if evicts else self.first_empty(layer)
        self.on_evict(layer, slot)
        pos = self.q_pos[:, None, :].expand(-1, pc.shape[1], 1)
        pc.scatter_(2, slot[:, :, None], pos)
        if evicts and not self.decode_attention:
            self.score[layer].scatter_(2, slot[:, :, None], self.token_scores(layer, k, v, pos))
        self.write_slots(layer, slot, k, v)
        return slot

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """Decode attention of q [B, H_q, 1, D] over every slot of the layer (empty ones masked):
        the cost is bounded by what is kept, and the shape does not change as the cache fills
        (a compiled step would otherwise specialize).  Sparse readers replace this."""
        return self.slots.attend(layer, q, self.visible(layer), self.pos[layer], self.q_pos)

    def storage(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Composition hook: (k, v [B, H_kv, C, D], visible [B, H_kv, C]) of the layer as the
        current query may read it; slots keep their index until overwritten."""
        return (*self.slots.tensors(layer), self.visible(layer))

    # ----------------------------------------------------------------- K/V format
    # How slots hold K/V is the object `self.slots` (DenseSlots: the compute dtype; cache/quantized.py's
    # KIVISlots: KIVI-packed, chosen by --kv-bits through with_kv_bits).  Policies reach stored K/V only
    # through these delegates (and `attend`, `storage`), which hand the format the layer's slot table.
    @property
    def k(self) -> list:
        """Per layer, the format's key storage (DenseSlots: [B, H_kv, C, D]; KIVISlots: a SlotStore)."""
        return self.slots.k

    @property
    def v(self) -> list:
        """Per layer, the format's value storage (KIVISlots: the same SlotStore as `k`)."""
        return self.slots.v

    @property
    def kv_bits(self) -> int:
        return self.slots.bits

    @property
    def kv_group(self) -> int:
        return self.slots.group

    @property
    def kv_residual(self) -> int:
        return self.slots.residual

    def write_kept(self, layer: int, kc: Tensor, vc: Tensor) -> None:
        """The kept prompt tokens kc, vc [B, H_kv, n, D] into slots [0, n) (pos already written)."""
        self.slots.write_kept(layer, kc, vc, self.pos[layer], self.q_pos)

    def write_slots(self, layer: int, slot: Tensor, k: Tensor, v: Tensor, where: Tensor | None = None) -> None:
        """k, v [B, H_kv, 1, D] into slot [B, H_kv] (pos already written); where [B, H_kv] bool: only there."""
        self.slots.write(layer, slot, k, v, self.pos[layer], self.q_pos, where)

    def read_slots(self, layer: int, slot: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H_kv, 1, D] held by slot [B, H_kv]."""
        return self.slots.read(layer, slot, self.pos[layer], self.q_pos)

    def key_cosine(self, layer: int, k: Tensor) -> Tensor:
        """Cosine similarity of k [B, H_kv, 1, D] with every slot's key -> [B, H_kv, C] fp32."""
        return self.slots.cosine(layer, k, self.pos[layer], self.q_pos)

    def attend_and_probs(self, layer: int, q: Tensor, k: Tensor, v: Tensor):
        """`attend_with_new` over the layer's slots plus the new token -> (out, p_old, p_new)."""
        return self.slots.attend_and_probs(layer, q, k, v, self.visible(layer), self.pos[layer], self.q_pos)

    def dense_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """(k, v) [B, H_kv, C, D] of every slot in the compute dtype, for host-side one-off reads
        (a packed format makes a copy here: never call it in the decode step)."""
        return self.slots.dense(layer, self.pos[layer], self.q_pos)

    def kv_store(self, layer: int):
        """(store, pos [B, H_kv, C], now [B]): the packed slots a sparse reader reads (KIVISlots only).  Before
        the batch's first forward (a reader building its index over the rows adopted so far) `now` is each
        row's newest position as adopt recorded it."""
        q_pos = self.q_pos if self.q_pos is not None else self.row_now[:, None]
        return self.slots.kv_store(layer, self.pos[layer], q_pos)

    def visible(self, layer: int) -> Tensor:
        """Slots [B, H_kv, C] the current query may attend (filled, within a sliding window)."""
        pc = self.pos[layer]
        visible = pc >= 0
        if self.sliding_window:
            visible &= self.q_pos[:, None, :] - pc < self.sliding_window
        return visible

    def first_empty(self, layer: int) -> Tensor:
        """The lowest empty slot [B, H_kv] (the appending layers' victim)."""
        return first_min((self.pos[layer] >= 0).float())

    def protected(self, layer: int, n_sink: int, window: "int | Tensor") -> Tensor:
        """Slots [B, H, C] an evicting layer never gives up at this step: the first n_sink
        tokens and the `window` most recent (an int, or per row [B, 1, 1]; the new token being one of them)."""
        pos = self.pos[layer]
        return (pos < n_sink) | (pos > self.q_pos[:, None, :] - window)

    def lowest(self, layer: int, score: Tensor, keep: Tensor) -> Tensor:
        """Victim [B, H]: an empty slot if any, else the slot of lowest score outside `keep` [B, H, C] and a
        question being appended (`held`).  A row never takes the slots past its own budget (a batch allocates
        the largest row's): they stay closed, so the row holds what it holds alone."""
        score = score.masked_fill(keep | self.held(layer), ALWAYS).masked_fill(self.pos[layer] < 0, NEVER)
        if self.budgeted:
            slots = torch.arange(score.shape[-1], device=score.device)
            score = score.masked_fill(slots >= self.row_budget[:, layer, None, None], ALWAYS)
        return first_min(score)

    def kept_positions(self, layer: int) -> Tensor:
        return self.pos[layer][:, :, :self.used_slots(layer)]

    def kv_bytes(self) -> dict:
        layers = [i for i, k in enumerate(self.k) if k is not None]
        allocated = sum(self.slots.nbytes(i) for i in layers)
        live = sum(self.slots.nbytes(i, self.used_slots(i)) for i in layers)
        return {"allocated": allocated, "live": live, "read_per_step": allocated}

    def describe(self) -> dict:
        d = {"policy": self.name, **param_values(self), **self.slots.describe()}
        rows = [b for b, tokens in enumerate(self.row_tokens) if tokens is not None]     # rows holding a request
        if rows:            # the token budget each row's prompt resolved to (one number when they agree)
            resolved = {self.row_tokens[b] for b in rows}
            d["resolved_budget"] = resolved.pop() if len(resolved) == 1 else list(self.row_tokens)
        if self.prompt_length and any(k is not None for k in self.k):
            d["kept_prompt_tokens_per_layer"] = list(self.kept)
            least = int(self.row_budget[rows].min()) if rows else min(map(self.layer_budget, range(len(self.k))))
            if self.prompt_length <= least:
                d["note"] = f"budget >= prompt ({self.prompt_length} tokens): the prompt is kept whole"
        return d
