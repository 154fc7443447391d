"""Continuous batching: RowBatch, a running batch that requests join (staged prefill, Pending) and leave."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from model import Transformer
from runtime.context import context_rows, prefill_rows
from runtime.memory import SIZE_STEP, row_bytes, size_class, sized_rows
from runtime.prefix_cache import PrefixCache, common_prefix
from runtime.steps import chunk_end, decode_step, left_pad, prefill_step, run_decode, run_prefill


@dataclass(eq=False)
class Pending:
    """A request being admitted (RowBatch.start): its prompt and how far its prefill has come."""
    ids: list[int]
    row: int                            # the row it takes once its prompt is prefilled
    prefix_len: Optional[int] = None    # where a shared prefix ends, when the caller knows (prefix_cache.py)
    done: int = 0                       # prompt tokens in the scratch so far (reused ones included)
    reused: int = 0                     # prompt tokens copied from a kept prefix
    snapshot_at: int = 0                # keep the prefix of this many tokens when the prefill reaches it (0: none)
    started: bool = False
    new_tokens: Optional[int] = None    # tokens it may generate (None: max_new_tokens): what its row must hold
    protocol: str = "aware"             # how its prompt is held: "exact", "aware" or "agnostic" (RowBatch)
    question: list[int] = field(default_factory=list)   # agnostic: prompt tokens still to append, one a step
    kept: Optional[object] = None       # exact: the kept prefix its prompt starts with (reused or snapshotted)
    agnostic: bool = True               # may take the agnostic protocol (False: only exact reuse, else "aware")
    alone: bool = False                 # prefilled alone from now on (a group it was in failed)


class RowBatch:
    """A running batch that requests join and leave (continuous batching; cache/contract.py, "admission").

    A policy with admission "row" takes requests into rows of their own: prompts are prefilled in a separate
    instance of the policy (`scratch`), then each moves into a free row (`policy.adopt`) while the other rows
    keep their state.  Admission is staged: `start` queues a request (it reserves a row), each `advance` runs one
    prefill chunk (at most prefill_chunk tokens of each prompt, `chunk_end`; a compressing policy stages the
    chunks and compresses the prompt with the last, cache/staging.py) of the oldest one, so a server alternates
    one chunk with one decode `step` of the running rows and a long prompt never stalls them for its whole
    length.  The oldest one's prefill takes along up to prefill_batch - 1 later requests that start where it
    starts (the same kept prefix, or none) and plan no snapshot: their prompts go through the model together,
    left-padded in a prefill_batch-row scratch (`group`; the linear layers run on prefill_batch times the rows,
    where the CPU's matrix units are faster per token), and join the batch together.  (Not in KIVI storage, whose
    quantization groups are runs of slots: padding would move them, so its prompts are prefilled one at a time.)
    `admit` is start + advance until done.  Every `step` decodes all rows together, each at its own position;
    free rows ride along at position -1 and nothing of theirs is read or kept.  A policy with admission
    "batch" makes decisions for the whole batch (layer budgets, sharing configurations), so requests start
    only in an empty batch, all those started together prefilled as one left-padded batch by one advance (as
    `generate` does).  Storage is fixed when the batch is made: a policy with `ratio=` (its budget a share of
    each prompt) holds in every row the budget of a max_seq_length-token prompt, and each request resolves its
    own, smaller or equal, at admission.

    prefix_bytes > 0 keeps prefilled prefixes (prefix_cache.py) when the policy declares prefix_reuse: a prompt
    starting with a kept prefix prefills only the rest, exactly (protocol "exact").  With agnostic=True a policy
    without prefix_reuse that admits rows keeps compressed prefixes instead (the question-agnostic protocol of
    `prefill_context` / `generate(context=)`): a shared prefix is prefilled and compressed once alone, a prompt
    starting with it has its row adopt it and appends the rest of its prompt one decode step each (`step` feeds
    them; `joined` lists the rows whose prompt the latest step completed), protocol "agnostic"; where its
    question and answer do not fit a row's room (max_new_tokens), or its question is longer than max_question
    tokens (appended one a step, it would hold back its first token that many steps), its whole prompt is
    prefilled ("aware").
    `reuse_off` says why a batch keeps no prefixes.  With share_prefix (exact reuse; off for a compiled decode
    step, which would recompile when rows start and stop sharing) a request's row reads the kept prefix its
    prompt started with in place instead of a copy (DenseCache.adopt(prefix=)): many questions about one
    document read its K/V once per step for all their rows (several documents at once: FullCache.max_prefixes), a
    kept prefix counted as referenced (PrefixCache.acquire) while rows read it, so the LRU never drops it then.

    kv_memory (bytes; None: no bound) bounds the K/V bytes of the rows (runtime/memory.py): a policy whose rows
    have a fixed size gets min(max_batch, kv_memory // row_bytes) rows; `full` in a plain dtype sizes its rows to
    the requests (every row the capacity class of the longest request in the batch, as many rows as fit) and is
    reshaped between steps when a request needs another shape; `can_start` says whether one may start now.

        batch = RowBatch(model, lambda: make_policy("snapkv"), max_batch=8, max_seq_length=4096, max_new_tokens=256)
        p = batch.start(ids)                    # while batch.room > 0
        for row, logits in batch.advance():     # one prefill chunk; requests whose prompt is complete, logits [V]
            ...
        logits = batch.step({row: token})       # [B, V]: one decode step of every active row
        batch.release(row)                      # the request is done: its row is free
    """

    def __init__(self, model: Transformer, make_policy, max_batch: int, max_seq_length: int, max_new_tokens: int,
                 prefill=prefill_step, decode=decode_step, prefill_chunk: int = 1024, prefix_bytes: int = 0,
                 min_prefix: int = 32, agnostic: bool = False, share_prefix: bool = True,
                 kv_memory: Optional[int] = None, prefill_batch: int = 1, max_question: int = 64):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        if prefill_batch < 1:
            raise ValueError(f"prefill_batch must be at least 1, got {prefill_batch}")
        if max_question < 1:
            raise ValueError(f"max_question must be at least 1, got {max_question}")
        self.max_question = max_question
        self.model, self.make_policy = model, make_policy
        self.max_seq_length, self.max_new_tokens = max_seq_length, max_new_tokens
        self.prefill, self.decode, self.prefill_chunk, self.prefill_batch = prefill, decode, prefill_chunk, prefill_batch
        self.share_prefix, self.kv_memory = share_prefix, kv_memory
        self.policy, self.scratch = make_policy(), make_policy()
        self.sized = kv_memory is not None and sized_rows(self.policy)
        self.max_batch, rows = self.memory_rows(max_batch) if kv_memory is not None else (max_batch, max_batch)
        for policy in (self.scratch, self.policy):     # storage for prompt + max_new_tokens, fixed at setup
            policy.decode_room = max_new_tokens
            model.setup_caches(1 if policy is self.scratch else rows, max_seq_length, policy)
        self.rows = self.policy.admission == "row"     # (known once set up: e.g. ds's channel source)
        if not self.rows:
            self.scratch = None
        self.next_pos = [-1] * self.max_batch     # each row's next position (-1: free)
        self.need = [0] * self.max_batch          # each row's request: prompt + the tokens it may generate
        self.batch_size = rows                # rows of the policy's storage (batch admission: the group's)
        self.steps = 0                        # decode steps since the batch was last empty
        self.pending: list[Pending] = []      # started, not yet admitted (oldest first)
        self.group: list[Pending] = []        # those being prefilled together now, scratch row g holding group[g]
        self.group_tokens = self.group_pos = None   # their prompts' rest, left-padded [G, T]; positions (-1: pad)
        self.group_col = self.group_start = 0     # columns of group_tokens prefilled so far; the prompts' first one
        self.scratch_rows = 1                 # rows the scratch is set up for
        self.prefill_since_step = 0           # prompt tokens prefilled while active rows waited for their next step
        self.prefill_tokens = 0               # prompt tokens prefilled in all (prefix reuse: less than prompted)
        self.appending: dict[int, Pending] = {}   # agnostic: rows appending the rest of their prompt
        self.joined: list[int] = []           # rows whose prompt the latest step completed (their logits are its last)
        self.agnostic = agnostic and self.rows and not self.policy.prefix_reuse
        self.prefixes, self.reuse_off = None, None
        if prefix_bytes and self.rows and (self.policy.prefix_reuse or self.agnostic):
            self.prefixes = PrefixCache(prefix_bytes, min_prefix)
        elif prefix_bytes:
            self.reuse_off = (f"policy {self.policy.name!r} keeps no prefixes: it cannot continue a prefilled prefix "
                              f"exactly (prefix_reuse, cache/contract.py), and " +
                              ("admits whole batches" if not self.rows else "agnostic reuse is off"))

    @property
    def active(self) -> list[int]:
        return [r for r, p in enumerate(self.next_pos) if p >= 0]

    def memory_rows(self, max_batch: int) -> tuple[int, int]:
        """kv_memory's rows -> (the most rows the batch may hold, rows of its storage now); sized rows: the
        capacity class where max_batch rows fit kv_memory (at least SIZE_STEP tokens).  ValueError when not one
        row fits."""
        cost = row_bytes(self.model, self.make_policy, self.max_seq_length, self.max_new_tokens,
                         SIZE_STEP if self.sized else None)
        rows = min(max_batch, self.kv_memory // cost)
        if rows < 1:
            raise ValueError(f"kv_memory {self.kv_memory} bytes hold no row of policy {self.policy.name!r}: a row "
                             f"{'of ' + str(SIZE_STEP) + ' tokens ' if self.sized else ''}costs {cost} bytes")
        if not self.sized:
            return rows, rows
        self.token_bytes = cost // SIZE_STEP
        per_row = self.kv_memory // (max_batch * self.token_bytes)
        self.policy.row_capacity = max(SIZE_STEP, min(per_row // SIZE_STEP * SIZE_STEP, self.max_seq_length))
        return max_batch, rows

    @property
    def room(self) -> int:
        """Requests that can start now (sized rows: of a length the storage holds now; `can_start`)."""
        if self.rows:
            return sum(p < 0 for p in self.next_pos[:self.batch_size]) - len(self.pending)
        return 0 if self.active else self.max_batch - len(self.pending)

    def can_start(self, n_tokens: int) -> bool:
        """Whether a request of n_tokens (prompt + the most it may generate) can start now: a free row and,
        with sized rows, a shape of the storage (this one or one its rows can move to) that kv_memory holds.
        True also for a request that can never start (`start` then says why)."""
        if not self.sized:
            return self.room > 0
        return self.shape_for(n_tokens) is not None or self.never_fits(n_tokens)

    def never_fits(self, n_tokens: int) -> bool:
        return self.sized and size_class(n_tokens, self.max_seq_length) * self.token_bytes > self.kv_memory

    def shape_for(self, n_tokens: int) -> Optional[tuple[int, int]]:
        """Sized rows: (rows, capacity) of a storage that holds the rows' requests and one of n_tokens, kv_memory
        bytes at most: the current one if it can, else the capacity class of the longest request and as many rows
        as fit it (the rows held must keep their indices) -> None when none can now."""
        taken = [r for r in range(self.max_batch) if self.next_pos[r] >= 0] + [p.row for p in self.pending]
        if n_tokens <= self.policy.capacity and self.room > 0:
            return self.batch_size, self.policy.capacity
        capacity = size_class(max([n_tokens] + [self.need[r] for r in taken]), self.max_seq_length)
        rows = min(self.max_batch, self.kv_memory // (capacity * self.token_bytes))
        return (rows, capacity) if len(taken) < rows and all(r < rows for r in taken) else None

    def reshape(self, rows: int, capacity: int) -> None:
        """Sized rows: move the batch's rows into storage of `rows` rows of `capacity` slots (between steps)."""
        policy = self.make_policy()
        policy.decode_room, policy.row_capacity = self.max_new_tokens, capacity
        self.model.setup_caches(rows, self.max_seq_length, policy)
        policy.take_rows(self.policy)
        self.policy, self.batch_size = policy, rows

    def start(self, ids: list[int], prefix_len: Optional[int] = None, new_tokens: Optional[int] = None,
              agnostic: bool = True) -> Pending:
        """Queue the request `ids` (token ids; prefix_len: where a prefix shared with other requests ends, if
        known; new_tokens: the most it may generate, default max_new_tokens; agnostic=False: never the agnostic
        protocol, its whole prompt prefilled with its question) for admission -> its Pending, holding the row it
        will take.  ValueError when none is free."""
        if not ids:
            raise ValueError("empty prompt")
        need = len(ids) + (self.max_new_tokens if new_tokens is None else new_tokens)
        if self.never_fits(need):
            raise ValueError(f"a request of {need} tokens (prompt + max_tokens) needs more than the kv_memory of "
                             f"{self.policy.name!r} ({self.kv_memory} bytes, {self.token_bytes} a token)")
        shape = self.shape_for(need) if self.sized else None
        if shape is not None and shape != (self.batch_size, self.policy.capacity):
            self.reshape(*shape)
        if self.room < 1 or (self.sized and shape is None):
            raise ValueError("no room to start a request now (batch.can_start is False)")
        taken = {p.row for p in self.pending}
        rows = self.batch_size if self.rows else self.max_batch       # (batch admission: set up per group)
        row = next(r for r in range(rows) if self.next_pos[r] < 0 and r not in taken)
        self.need[row] = need
        protocol = "exact" if self.policy.prefix_reuse else "aware"
        self._snapshot_for(ids)
        self.pending.append(Pending(list(ids), row, prefix_len, new_tokens=new_tokens, protocol=protocol,
                                    agnostic=agnostic))
        return self.pending[-1]

    def _snapshot_for(self, ids: list[int]) -> None:
        """A request starting while the oldest one's prompt is being prefilled (exact reuse): where they share a
        prefix the prefill has not yet passed, none is planned, and it is at least min_prefix tokens longer
        than the kept one that prompt started from, that prefill snapshots it, as if
        this request had been waiting when it began (prefix_cache.py, boundary); else this request would
        prefill the shared prefix again."""
        p = self.group[0] if len(self.group) == 1 and self.prefixes is not None and not self.agnostic else None
        if p is None or p.snapshot_at:
            return
        n = min(common_prefix(p.ids, ids), len(p.ids) - 1)
        if n - p.reused >= self.prefixes.min_tokens and n > p.done and tuple(p.ids[:n]) not in self.prefixes.entries:
            p.snapshot_at = n

    def cancel(self, pending: Pending) -> None:
        """Drop a started request before its prompt is complete (its client left); its row is free again."""
        if pending in self.pending:
            self.pending.remove(pending)
        else:
            self.release(pending.row)               # an agnostic one appending its question

    def holds(self, pending: Pending) -> bool:
        """Whether a started request's prompt is still being admitted (False once complete, cancelled or dropped
        by a failed `advance`)."""
        return pending in self.pending or self.appending.get(pending.row) is pending

    def advance(self) -> list[tuple[int, torch.Tensor]]:
        """One admission step: a prefill chunk of the oldest pending request (admission "row"), or every
        pending request's prefill (admission "batch") -> [(row, logits [V] of the prompt's last position)] of
        the requests whose prefill is now complete: they decode from the next step.  A failure drops the
        request it happened in (the whole group under admission "batch"; `holds` tells) and is re-raised; a
        failed chunk of prompts prefilled together drops none of them: each is prefilled again alone."""
        if not self.pending:
            return []
        if not self.rows:
            return self._prefill_group()
        live = self.live()
        if not live:                                    # (every one of a group cancelled: a new one)
            self.group = []
        p = live[0][1] if live else self.pending[0]
        try:
            agnostic = self.agnostic and p.agnostic and self.prefixes is not None and not p.started
            context = self._context(p) if agnostic else None
            logits = None if context is not None else self._chunk()
        except BaseException:
            together, group = len(self.group) > 1, [q for _, q in self.live()] or [p]
            self.group = []
            if together:                       # no one prompt to blame: each is prefilled again alone, and
                for q in group:                # only one that fails alone fails
                    q.started, q.done, q.reused, q.kept, q.snapshot_at, q.alone = False, 0, 0, None, 0, True
            elif p in self.pending:
                self.pending.remove(p)
            raise
        if context is None and logits is None:
            return []
        if not self.active:
            self.steps = 0
        if context is not None:
            self.pending.remove(p)
            self.policy.adopt(p.row, context)
            self.next_pos[p.row] = p.done
            self.policy.hold_question(p.row, p.done, len(p.ids))
            self.appending[p.row] = p
            return []
        group, self.group = self.live(), []
        for g, q in group:
            self.pending.remove(q)
            if self.share_prefix and q.kept is not None:        # its row reads the prefix in place
                self.policy.adopt(q.row, self.scratch, other_row=g, prefix=q.kept)
                if self.policy.row_prefix[q.row] is q.kept:
                    self.prefixes.acquire(q.kept)
            else:
                self.policy.adopt(q.row, self.scratch, other_row=g)
            self.next_pos[q.row] = q.done
        return [(q.row, logits[g]) for g, q in group]

    def live(self) -> list[tuple[int, Pending]]:
        """(scratch row, request) of the group's requests still pending (a cancelled one leaves its row behind)."""
        return [(g, q) for g, q in enumerate(self.group) if q in self.pending]

    def _context(self, p: Pending):
        """The agnostic protocol for p: a kept compressed prefix of its prompt, or one it shares with others (the
        same boundary as exact reuse), compressed now -> that one-row instance, p.question the rest of its prompt,
        held whole until p's answer starts (the contract's hold_question); None where none is shared, the rest and
        p's answer would not fit a row's room (decode_room), or the rest is longer than the context's
        question_room."""
        shortest = self._shortest(p)
        n, context = self.prefixes.lookup(p.ids, shortest)
        at = self.prefixes.boundary(p.ids, [q.ids for q in self.pending if q is not p], p.prefix_len)
        reused = n
        if context is None and at >= shortest:
            n, context, reused = at, self._compress(p.ids[:at]), 0
        held = None if context is None else context.question_room(0)
        if context is None or (held is not None and len(p.ids) - n > held):
            return None                     # (a context compressed now stays kept for the next request)
        p.started, p.done, p.protocol, p.question, p.reused = True, n, "agnostic", p.ids[n:], reused
        return context

    def _shortest(self, p: Pending) -> int:
        """The agnostic protocol's shortest shared prefix for p: its question and answer must fit a row's room, and
        its question, appended one token a step, be at most max_question tokens."""
        room = self.max_new_tokens - (self.max_new_tokens if p.new_tokens is None else p.new_tokens)
        return max(len(p.ids) - min(room, self.max_question), 1)

    def _compress(self, ids: list[int]):
        """ids prefilled and compressed alone in a one-row instance set up as the rows are (prefill_context's
        steps), kept in the prefix LRU -> that instance."""
        try:
            context = context_rows(self.model, self.make_policy, self.max_new_tokens, self.max_seq_length)
            prefill_rows(self.model, ids, self.prefill_chunk)
        finally:
            self.model.use_cache(self.policy)
        self.count_prefill(len(ids))
        self.prefixes.insert(tuple(ids), context, context.kv_bytes()["allocated"])
        return context

    def admit(self, requests: Sequence[list[int]]) -> list[tuple[int, torch.Tensor]]:
        """Admit the first of `requests` (token-id lists) that fit now -> [(row, logits [V] of the prompt's
        last position)]; the others must wait (no free row, or a batch-admission policy still running)."""
        if self.pending:
            raise ValueError("admit needs no staged request pending (finish those with advance)")
        started = [self.start(ids) for ids in requests[:max(self.room, 0)]]
        done: dict = {}
        while self.pending:
            done.update(self.advance())
        return [(p.row, done[p.row]) for p in started]

    def _prefill_group(self) -> list[tuple[int, torch.Tensor]]:
        """Admission "batch": every pending request as one left-padded batch in an empty batch."""
        group, self.pending = [p.ids for p in self.pending], []
        self.count_prefill(sum(len(ids) for ids in group))
        tokens, input_pos = left_pad(group, 0, self.model.output.weight.device)
        self.model.setup_caches(len(group), self.max_seq_length, self.policy)
        self.batch_size = len(group)
        self.next_pos = [len(ids) for ids in group] + [-1] * (self.max_batch - len(group))
        self.steps = 0
        try:
            logits = run_prefill(self.model, tokens, input_pos, self.prefill, self.prefill_chunk)
        except BaseException:
            self.next_pos = [-1] * self.max_batch       # the group is dropped: the batch is empty again
            raise
        return list(enumerate(logits))

    def count_prefill(self, n: int) -> None:
        self.prefill_tokens += n
        self.prefill_since_step = self.prefill_since_step + n if self.active else 0   # (no row waits)

    def _chunk(self) -> Optional[torch.Tensor]:
        """Prefill the next chunk of the group's prompts in the scratch (a new group, `_begin`, when none is in
        progress) -> logits [G, V] of their prompts' last positions once complete, else None."""
        model = self.model
        if not self.group:
            self._begin()
        model.use_cache(self.scratch)
        try:
            group, T, start, c = self.group, self.group_tokens.shape[1], self.group_start, self.group_col
            end = T if self.scratch.prefill_in_one_pass else chunk_end(c, T, self.prefill_chunk)
            p = group[0]
            if p.done < p.snapshot_at:                  # (a lone prompt: columns are its positions past `start`)
                end = min(end, p.snapshot_at - start)
            logits = self.prefill(model, self.group_tokens[:, c:end], self.group_pos[:, c:end], start + c)
            self.count_prefill(int((self.group_pos[:, c:end] >= 0).sum()))
            self.group_col = end
            for g, q in enumerate(group):              # real tokens of row g: those past its padding
                q.done = start + max(0, end - (T - (len(q.ids) - start)))
            if len(group) == 1 and p.done == p.snapshot_at:
                self._snapshot(p)
            if end < T:
                return None
            self.scratch.end_prefill()
            return logits
        finally:
            model.use_cache(self.policy)

    def _begin(self) -> None:
        """A new group: the oldest pending request (from the longest kept prefix of it, if any, fixing where to
        snapshot), and, when it plans no snapshot, up to prefill_batch - 1 later ones not started that would start
        as it does (`_joins`); the scratch set up for them, their prompts' rest left-padded."""
        p = self.pending[0]
        self._plan(p)
        group = [p]
        most = self.prefill_batch if self.policy.kv_bits == 16 else 1   # (KIVI groups slots: padding moves them)
        for q in self.pending[1:]:
            if len(group) == most or p.snapshot_at or p.alone:
                break
            if not q.started and not q.alone and self._joins(q, p):
                self._plan(q)
                group.append(q)
        if self.scratch_rows != len(group):           # (a new instance: set up once per size of group)
            self.scratch, self.scratch_rows = self.make_policy(), len(group)
            self.scratch.decode_room = self.max_new_tokens
            self.model.setup_caches(len(group), self.max_seq_length, self.scratch)
            self.model.use_cache(self.policy)
        self.scratch.reset()
        start = self.group_start = p.done
        for g, q in enumerate(group):
            if q.kept is not None:
                self.scratch.adopt(g, q.kept)
        device = self.model.output.weight.device
        tokens, pos = left_pad([q.ids[start:] for q in group], 0, device)
        self.group, self.group_tokens, self.group_col = group, tokens, 0
        self.group_pos = torch.where(pos >= 0, pos + start, pos)
        self.scratch.before_prefill(self.group_pos)

    def _plan(self, p: Pending) -> None:
        """p starts: from the longest kept prefix of it (exact reuse), if any; where its prefill snapshots."""
        if self.prefixes is not None and not self.agnostic:
            n, snapshot = self.prefixes.lookup(p.ids)
            if snapshot is not None:
                p.done = p.reused = n
                p.kept = snapshot
            at = self.prefixes.boundary(p.ids, [q.ids for q in self.pending if q is not p], p.prefix_len)
            p.snapshot_at = at if at > p.done else 0
        p.started = True

    def _joins(self, q: Pending, p: Pending) -> bool:
        """Whether q, not started, may be prefilled with p (planned): q would take the aware or exact protocol,
        start from p's kept prefix (or none, as p) and plan no snapshot."""
        if self.prefixes is None:
            return True
        if self.agnostic:                               # (`_context` would find or make no prefix for it)
            return not q.agnostic or (self.prefixes.peek(q.ids, self._shortest(q))[1] is None and
                                      self.prefixes.boundary(q.ids, [o.ids for o in self.pending if o is not q],
                                                             q.prefix_len, remember=False) < self._shortest(q))
        n, snapshot = self.prefixes.peek(q.ids)
        at = self.prefixes.boundary(q.ids, [o.ids for o in self.pending if o is not q], q.prefix_len, remember=False)
        return snapshot is p.kept and n == p.done and at <= n

    def _snapshot(self, p: Pending) -> None:
        """Keep the scratch's first p.done tokens as a prefix: a one-row instance sized to them."""
        snapshot, weight = self.make_policy(), self.model.norm.weight
        snapshot.decode_room = self.max_new_tokens
        snapshot.setup(self.model.args, 1, p.done, weight.dtype, weight.device)
        snapshot.adopt(0, self.scratch)
        self.prefixes.insert(tuple(p.ids[:p.done]), snapshot, snapshot.kv_bytes()["allocated"])
        p.kept = snapshot

    def step(self, tokens: dict[int, int]) -> torch.Tensor:
        """One decode step: tokens {row: the token at the row's next position} for every active row but those
        appending their prompt (fed its next token here) -> logits [B, V] (rows not given are free, or append:
        their logits mean nothing, but for the rows in `joined`, whose prompt is now complete)."""
        answering = [r for r in self.active if r not in self.appending]
        if sorted(tokens) != answering:
            raise ValueError(f"step needs one token for each active row {answering}, got rows {sorted(tokens)}")
        tokens = {**tokens, **{row: p.question[0] for row, p in self.appending.items()}}
        device = self.model.output.weight.device
        token = torch.zeros(self.batch_size, 1, dtype=torch.long)
        pos = torch.full((self.batch_size, 1), -1, dtype=torch.long)
        for row, t in tokens.items():
            token[row, 0], pos[row, 0] = t, self.next_pos[row]
        logits = run_decode(self.model, token.to(device), pos.to(device), self.steps, self.decode)
        for row in tokens:
            self.next_pos[row] += 1
        self.joined = []
        for row, p in list(self.appending.items()):
            del p.question[0]
            if not p.question:
                del self.appending[row]
                self.joined.append(row)
        self.steps += 1
        self.prefill_since_step = 0
        return logits

    def release(self, row: int) -> None:
        """The request in `row` is done (finished or abandoned): the row is free for the next one."""
        if self.next_pos[row] < 0:
            raise ValueError(f"row {row} holds no request")
        self.next_pos[row] = -1
        self.need[row] = 0
        self.appending.pop(row, None)
        if self.rows:
            read = getattr(self.policy, "row_prefix", None)
            prefix = read[row] if read is not None else None
            self.policy.release(row)
            if prefix is not None:
                self.prefixes.drop(prefix)
