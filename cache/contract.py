"""The cache-policy contract: what `model.Transformer` and `runtime/` call on a policy, in one place.

A policy is any object with these members (`cache/full.py`'s FullCache, the `full` policy, is the smallest
one: model.py's plain DenseCache with rows; `cache/base.py`'s EvictionPolicy and `cache/sparse_read.py`'s
SparseReader implement the mechanics most policies share, so a new policy usually writes only its scoring rule: see
docs/adding-a-policy.md).  Shapes: B batch rows, T tokens of this forward, H_q query heads,
H_kv KV heads, G = H_q / H_kv, D head_dim, C a layer's slots.

When each member is called, for one request:

    prepare(model, tokenizer)        once, before setup (engine.generate, the evals, the benchmark)
    setup(args, B, S, dtype, device) model.setup_caches: allocate what does not depend on the prompt
    before_prefill(input_pos)        host side, the whole prompt's positions [B, T]
    begin(input_pos, n); prefill(...)  each prompt chunk (one chunk if prefill_in_one_pass), every layer
    end_prefill()                    the prompt is complete
    before_decode_step(step)         host side, before decode step 0, 1, ...
    begin(input_pos, n); decode(...) each decode step ([B, 1]), every layer; the caller says which forward is
                                     a decode step (model.forward's decode=True) and may pass n_filled
    reset()                          the next request reuses the storage

A policy whose `static_decode` is True (every registered one) may instead take *static* decode steps, the ones a
CUDA graph replays (runtime.steps.GraphDecode): the live lengths stay on the device and the step's one int is a
bucketed read bound (cache.full.read_bound; 0 where the storage's shapes are fixed), so one graph serves every step
inside a bucket:

    n_read = begin_static_step()     host side, before the step: the host count advances; the bound to read
    static_tensors()                 every tensor the step reads or writes in place (marked static: never copied)
    begin_static(input_pos, n_read)  instead of begin, then decode(...) every layer, with no host count read

Requests that join and leave a running batch (runtime.rows.RowBatch, the server's continuous batching), for a
policy whose `admission` is "row":

    decode_room = N                  before setup: every row holds its prompt's kept tokens + N generated
                                     ones, so storage is allocated once at setup and never per request
    (scratch: an instance of G rows) setup(args, G, S, ...), reset(), then a whole prefill as above: G
                                     prompts left-padded (RowBatch's prefill_batch; G = 1: one prompt)
    adopt(row, scratch, g)           host side, between decode steps: the scratch's request g moves into the
                                     free row `row`; the other rows keep every bit of their state
    begin(input_pos); decode(...)    every row at its own position; a free row at position -1 (nothing of
                                     it is kept or read: its outputs are garbage and never used)
    release(row)                     host side: the row's request is done, its slots are empty

A question appended after a compressed context (the agnostic protocol: engine.generate(context=...) and
RowBatch's agnostic rows alike) is held whole:

    adopt(row, context)              the row holds the compressed context, positions [0, start)
    hold_question(row, start, end)   host side: positions [start, end) are its question, fed one decode step
                                     each; no decode step evicts them before the one at position `end` (the
                                     first answer token), so every one is held when that token is sampled.
                                     An evicting layer takes its victims from the rest (the context), so
                                     memory stays at the budget; from the first answer token on they are
                                     ordinary tokens (decode-time eviction may take them).  Per row: no other
                                     row is affected; release / adopt / reset forget it.
    question_room(row)               the longest question the row holds whole (None: nothing is evicted);
                                     hold_question refuses a longer one (ValueError)

The scratch's prompt comes in chunks of RowBatch's prefill_chunk (runtime.steps.chunk_end: a chunk after the
first holds at least 2 tokens: compressing policies take a one-token forward after the prompt's first as a
decode step), each chunk one step of the staged admission (RowBatch.start / advance, interleaved with the running rows' decode steps).  A
compressing policy (cache/base.py's EvictionPolicy) takes the chunks *staged*: its prompt's K/V wait
uncompressed in a buffer of the prompt's length, each chunk attends to everything staged so far, and
end_prefill compresses the whole prompt with the statistics one pass gives (`prefill_queries`: the last n
queries, staged too, or every query, summed chunk by chunk), so the kept tokens and logits are one pass's.
A policy with prefill_in_one_pass takes its whole prompt in one forward, so its admission step costs the
whole prompt: pod (it files the whole prompt into its ring and distant store), and an EvictionPolicy
without decode_room (engine.generate's batch: staging would hold every row's prompt uncompressed beside the
cache).  A policy with prefix_reuse lets RowBatch keep a prefilled prefix:

    (snapshot: a one-row instance)   setup(args, 1, n, ...), adopt(0, scratch) while the scratch's prompt
                                     has filled positions [0, n) (no end_prefill yet)
    scratch.adopt(g, snapshot)       a later request starting with those n tokens: its scratch row goes on with
                                     before_prefill / prefill chunks at positions n.. / end_prefill, and gets
                                     what one prefill of the whole prompt gives (tests/test_rowbatch.py)

A row's tokens and logits are those of the same request run alone (tests/test_policy_matrix.py,
test_requests_join_and_leave_rows).  Rows do not depend on the decode step number.  A policy that decides
for the whole batch (PyramidKV's budgets, D2O's layer budgets, SimLayerKV's lazy layers, HShare's
sharing configuration, Double Sparsity's prompt-ranked channels, POD's blocks) declares admission "batch":
requests then start only in an empty batch, together (one left-padded prefill), as in engine.generate.

Capabilities are declared as class attributes (never probed with hasattr):
    prefill_in_one_pass  the engine must feed the whole prompt in one forward (pod; an EvictionPolicy without
                         decode_room: a property; readers report their storage's); False: chunks of >= 2 tokens
    is_sparse_reader     a reader (ds, quest, hshare): composes as STORAGE+READER over `inner`
    decode_attention     decode needs each step's attention probabilities (H2O, D2O, TOVA), so no
                         reader may replace its attention
    reader_composable    a sparse reader may replace its decode attention (False when it measures
                         decode attention itself, e.g. SimLayerKV's decode strategy)
    kv_bits, kv_group    16 and 0 for compute-dtype storage; KIVI-packed storage says its bits and G
    admission            "row" (requests join and leave single rows: release/adopt) or "batch"
    prefix_reuse         a copy of a one-row instance part way through its prompt continues that prompt
                         exactly (above): only `full` in a plain dtype; compressing policies compress the
                         prompt as a whole, readers index a complete prompt, KIVI reads a later chunk's
                         prefix dequantized (chunk boundaries change its numbers)
    storage_kind         what holds the K/V: "dense" (`full`: every token, compute dtype; --kv-bits and
                         --kv-dtype swap it for "kivi" or "dense_dtype", and rows may share its prefix),
                         "slots" (the eviction family's slot tables; --kv-bits packs them in place),
                         "reader" (a sparse reader: its inner policy's), "own" (pod: a layout of its own)
    (model.DenseCache and its subclasses also declare fused_dense_decode: False when they replace its
    decode or storage, see model.DenseCache)
Attributes a policy sets up (setup, adopt) are declared as None (class attributes, __init__ or
__post_init__), never probed; `cache.register` refuses a class that lacks a member of CachePolicy below (contract_members).
`full_cache_args(n)` states the policy's promise about the full cache: the arguments under which it
keeps and reads every one of n tokens, so its logits equal the full cache's (None: no such promise).
The policy test matrix (tests/test_policy_matrix.py) checks every registered policy against this.

Tensor parallelism (`--tp N`, tp.py): each process sets up its policy with its own ModelArgs (n_heads
/ N, n_kv_heads / N), so a policy runs on that process's KV heads and needs nothing more, unless a
decision spans heads: then it reaches the process group only through `cache.shard.shard_of(args)`
(collectives that are identities in one process: `mean`, `all_reduce`, `all_gather`, `any`, and
`own` for the process's heads of a whole-model calibration file), called from code every process
runs in the same order (never from describe/kv_bytes).  Each policy's rule: docs/policies.md.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

from model import ModelArgs


@runtime_checkable
class CachePolicy(Protocol):
    name: str                       # registry name (--policy NAME); its parameters (the spec's arguments)
                                    # are its dataclass fields made by cache.params.param (none: not a dataclass)
    prefill_in_one_pass: bool
    is_sparse_reader: bool
    decode_attention: bool
    reader_composable: bool
    kv_bits: int
    kv_group: int
    admission: str                  # "row" or "batch" (module docstring)
    prefix_reuse: bool              # a prefilled prefix can be snapshotted and continued (module docstring)
    decode_room: Optional[int]      # generated tokens a row holds, set before setup (None: up to max_seq_length)
    renamed: dict                   # old parameter name -> new one (refused with a message naming it)
    n_filled: int                   # tokens seen so far (prompt + generated; the longest row), a host int
    storage_kind: str               # "dense", "dense_dtype", "kivi", "slots", "reader" or "own" (module docstring)
    static_decode: bool             # decode steps may run static (module docstring): begin_static_step, begin_static

    def prepare(self, model, tokenizer) -> None:
        """Host side: make per-checkpoint side data that is missing (calibration files beside
        model.args.checkpoint).  Most policies need none."""

    def setup(self, args: ModelArgs, max_batch_size: int, max_seq_length: int, dtype: torch.dtype,
              device) -> None:
        """Allocate what does not depend on the prompt; max_seq_length bounds prompt + generated."""

    def reset(self) -> None:
        """Forget every sequence; storage stays allocated."""

    def before_prefill(self, input_pos: Tensor) -> None:
        """Host side, once per request, input_pos [B, T] of the whole prompt (-1 = left padding):
        validate and allocate what depends on the prompt length (never inside a compiled step)."""

    def begin(self, input_pos: Tensor, n_filled: Optional[int] = None) -> None:
        """Once per forward before the layers, input_pos [B, T]: claim slots, build masks.  n_filled: the
        tokens held before this forward as the caller counts them (a compiled step's dynamic int), or None."""

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, H_q, T, D], k/v [B, H_kv, T, D] (RoPE applied) -> attention output [B, H_q, T, D];
        stores (or holds back, to compress) the layer's K/V."""

    def end_prefill(self) -> None:
        """The prompt is complete: compressing policies select what they keep here."""

    def before_decode_step(self, step: int) -> None:
        """Host side before decode step `step`: the one place a policy may sync or reallocate
        during decode (SimLayerKV's decode strategy trims lazy layers after step 0)."""

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One token: q [B, H_q, 1, D], k/v [B, H_kv, 1, D] -> [B, H_q, 1, D]; stores the token
        (appending, or evicting another) and attends over what is kept, without host syncs."""

    def release(self, row: int) -> None:
        """Host side (admission "row"): forget row `row`'s request; its slots are empty, other rows go on."""

    def adopt(self, row: int, other: "CachePolicy", other_row: int = 0) -> None:
        """Host side (admission "row"): move request `other_row` of `other` (the same spec, set up with the
        same max_seq_length and decode_room, its prefill complete) into the free row `row`."""

    def question_room(self, row: int) -> Optional[int]:
        """Host side: the longest question row `row` can hold whole (hold_question); None: no layer evicts."""

    def hold_question(self, row: int, start: int, end: int) -> None:
        """Host side: positions [start, end) of row `row` are a question being appended after its compressed
        context: no decode step before position `end` evicts them (module docstring).  ValueError when it is
        longer than question_room(row)."""

    def storage(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """(k, v [B, H_kv, C, D], visible [B, H_kv or 1, C]) a decode query may read: the hook a
        sparse reader composes with."""

    def kept_positions(self, layer: int) -> Tensor:
        """LongTensor [B, H_kv, n]: absolute positions held by the layer (-1 = empty slot)."""

    def kv_bytes(self) -> dict:
        """{"allocated", "live", "read_per_step"}: bytes counted from the real buffers."""

    def describe(self) -> dict:
        """Resolved hyper-parameters (and what the policy decided, e.g. layer budgets)."""

    @classmethod
    def full_cache_args(cls, n_tokens: int) -> Optional[dict]:
        """Arguments under which the policy keeps and reads all of n_tokens (logits equal the full
        cache's), or None when it makes no such promise."""


def contract_members() -> list[str]:
    """Every attribute and method CachePolicy declares: what `cache.register` checks a class for."""
    methods = [n for n, v in vars(CachePolicy).items() if not n.startswith("_") and callable(getattr(CachePolicy, n))]
    return sorted(set(CachePolicy.__annotations__) | set(methods))
