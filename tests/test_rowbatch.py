"""RowBatch's staged admission (start / advance: one prefill chunk between decode steps) and its reuse
of prefilled prefixes (runtime/prefix_cache.py), on the policy matrix's tiny random Llama."""
from __future__ import annotations

import pytest
import torch

from cache import make_policy
from runtime.context import append_tokens, context_rows, prefill_rows
from runtime.prefix_cache import PrefixCache, common_prefix
from runtime.rows import RowBatch
from runtime.steps import run_decode
from tests.test_policy_matrix import ARGS, model  # noqa: F401  (model: the tiny Llama fixture)

NEW = 16


def drive(batch: RowBatch, prompts: dict, arrivals: dict, staged: bool, prefix_len=None, new_tokens=None):
    """Greedy-decode `prompts` through `batch`: request n arrives at loop turn arrivals[n] (first come, first
    served) and leaves after NEW tokens.  Staged: start what fits (`can_start`: a free row; with kv_memory, the
    bytes), then one `advance` per turn; else `admit`.
    A request admitted from a kept compressed prefix (agnostic) joins when a step completes its prompt.
    -> (logits [NEW, V] per request, [(prompt tokens prefilled since the last step, requests mid-prefill)]
    at each decode step)."""
    got: dict = {n: [] for n in prompts}
    rows, waiting, starting, steps = {}, [], {}, []
    with torch.inference_mode():
        for t in range(50 * NEW):
            waiting += [n for n in prompts if arrivals[n] == t]
            if staged:
                while waiting and batch.can_start(len(prompts[waiting[0]]) + (new_tokens or batch.max_new_tokens)):
                    n = waiting.pop(0)
                    starting[batch.start(prompts[n], prefix_len, new_tokens).row] = n
                admitted = batch.advance()
                names = [starting.pop(row) for row, _ in admitted]
            else:
                admitted = batch.admit([prompts[n] for n in waiting])
                names = [waiting.pop(0) for _ in admitted]
            for (row, logits), n in zip(admitted, names):
                rows[n] = row
                got[n].append(logits)
            if rows or batch.appending:
                steps.append((batch.prefill_since_step, len(batch.pending)))
                logits = batch.step({r: int(got[n][-1].argmax()) for n, r in rows.items()})
                for n, r in list(rows.items()):
                    got[n].append(logits[r])
                    if len(got[n]) == NEW:
                        batch.release(r)
                        del rows[n]
                for r in batch.joined:
                    rows[starting[r]] = r
                    got[starting.pop(r)].append(logits[r])
            if not (rows or waiting or batch.pending or batch.appending) and t > max(arrivals.values()):
                break
    assert all(len(v) == NEW for v in got.values()), "a request did not finish"
    return {n: torch.stack(v) for n, v in got.items()}, steps


def prompts_of(lengths: dict, seed: int = 1, shared: int = 0) -> dict:
    """Random prompts of the given lengths; with shared > 0 all begin with the same `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, ARGS.vocab_size, (shared,), generator=g).tolist()
    return {n: head + torch.randint(0, ARGS.vocab_size, (k,), generator=g).tolist() for n, k in lengths.items()}


def row_batch(model, name: str, max_batch: int = 2, chunk: int = 32, **kw) -> RowBatch:  # noqa: F811
    return RowBatch(model, lambda: make_policy(name), max_batch, 400 + NEW, NEW, prefill_chunk=chunk, **kw)


@pytest.mark.parametrize("name", ["full", "snapkv", "pyramidkv"])
def test_staged_admission_interleaves_chunks_with_decode(model, name):  # noqa: F811
    """B's and C's long prompts are prefilled one chunk per turn while A (then B) decode: every request gets
    the tokens and logits that admit() gives it, and a decode step never waits for more than one chunk of
    prompt (compressing policies too: their chunks are staged; a policy with admission "batch" prefills its
    group whole, in an empty batch)."""
    prompts = prompts_of({"A": 40, "B": 300, "C": 170})
    arrivals = {"A": 0, "B": 2, "C": 3}
    got, steps = drive(row_batch(model, name), prompts, arrivals, staged=True)
    ref, _ = drive(row_batch(model, name), prompts, arrivals, staged=False)
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), f"request {n}'s tokens differ from admit's"
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)
    batch = row_batch(model, name)
    bound = 32 if batch.rows else max(len(p) for p in prompts.values())
    assert max(n for n, _ in steps) <= bound, steps
    if bound == 32:     # decode steps ran while a prompt was part way in (B's 300 tokens over 10 turns)
        assert sum(1 for _, mid in steps if mid) >= 9, steps


def test_admit_refuses_while_staged_requests_pend(model):  # noqa: F811
    batch = row_batch(model, "full", max_batch=1)
    batch.start([1, 2, 3])
    assert batch.room == 0
    with pytest.raises(ValueError, match="no room"):
        batch.start([4, 5])
    with pytest.raises(ValueError, match="pending"):
        batch.admit([[4, 5]])


@pytest.mark.parametrize("prefix_len", [None, 150])
def test_prefix_reuse_is_exact_with_full(model, prefix_len):  # noqa: F811
    """Four questions on one 150-token document: the first request's prefill keeps the document (its
    boundary: the prefix it shares with the waiting second request, or the explicit prefix_len), the others
    copy it and prefill only their question; every request's tokens and logits equal those without reuse."""
    prompts = prompts_of({"q1": 12, "q2": 20, "q3": 7, "q4": 16}, shared=150)
    arrivals = dict.fromkeys(prompts, 0)
    batch = row_batch(model, "full", prefix_bytes=1 << 30, min_prefix=16)
    got, _ = drive(batch, prompts, arrivals, staged=True, prefix_len=prefix_len)
    plain = row_batch(model, "full")
    ref, _ = drive(plain, prompts, arrivals, staged=True)
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), f"{n}'s tokens differ with prefix reuse"
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)
    stats = batch.prefixes.stats()
    assert (stats["hits"], stats["misses"], stats["reused_tokens"], stats["entries"]) == (3, 1, 450, 1), stats
    assert stats["bytes"] == batch.prefixes.entries[tuple(prompts["q1"][:150])][0].kv_bytes()["allocated"] > 0
    assert batch.prefill_tokens + 450 == plain.prefill_tokens == sum(map(len, prompts.values()))


def test_prompts_after_a_kept_prefix_are_prefilled_together(model):  # noqa: F811
    """prefill_batch=4, four questions on one document arriving together: the first prompt is prefilled alone (it
    snapshots the document), the other three start from that kept prefix and their questions (of different
    lengths, left-padded) go through the model as one group of three rows; every request's tokens and logits
    equal those without reuse or grouping."""
    prompts = prompts_of({"q1": 12, "q2": 20, "q3": 7, "q4": 16}, shared=150)
    arrivals = dict.fromkeys(prompts, 0)
    batch = row_batch(model, "full", max_batch=4, prefix_bytes=1 << 30, min_prefix=16, prefill_batch=4)
    rows_per_forward, prefill = [], batch.prefill
    batch.prefill = lambda m, tokens, *a: rows_per_forward.append(tokens.shape[0]) or prefill(m, tokens, *a)
    got, _ = drive(batch, prompts, arrivals, staged=True)
    ref, _ = drive(row_batch(model, "full", max_batch=4), prompts, arrivals, staged=True)
    assert rows_per_forward == [1] * 6 + [3], rows_per_forward      # q1: 162 tokens, chunks of 32 cut at 150
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), f"{n}'s tokens differ prefilled together"
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)
    stats = batch.prefixes.stats()
    assert (stats["hits"], stats["misses"], stats["reused_tokens"]) == (3, 1, 450), stats
    assert all(batch.policy.row_prefix[r] is not None for r in (1, 2, 3)) or not batch.active


@pytest.mark.parametrize("shared", [0, 150])
def test_rows_prefilled_together_hold_only_their_own_tokens(model, shared):  # noqa: F811
    """full, prompts of 40, 25 and 33 tokens prefilled together (left-padded to 40 after the kept prefix, if any):
    each row the batch adopts holds its own tokens only, not the padding (the batch's sized rows count on it:
    a short prompt padded to the longest once overflowed its capacity class after a reshape), and decodes as
    the prompt run alone."""
    prompts = prompts_of({"a": 40, "b": 25, "c": 33}, shared=shared)
    kw = {"prefix_bytes": 1 << 30, "min_prefix": 16, "prefix_len": shared} if shared else {}
    prefix_len = kw.pop("prefix_len", None)
    batch = row_batch(model, "full", max_batch=3, chunk=64, prefill_batch=3, **kw)
    if shared:                                      # the document kept first, by a request of its own
        drive(batch, {"doc": prompts["a"][:shared] + [1, 2]}, {"doc": 0}, staged=True, prefix_len=prefix_len)
    started = {n: batch.start(ids, prefix_len) for n, ids in prompts.items()}
    with torch.inference_mode():
        while batch.pending:
            batch.advance()
    for n, p in started.items():
        assert int(batch.policy.length[p.row]) == len(prompts[n]) and batch.next_pos[p.row] == len(prompts[n])
        assert (batch.policy.pos[p.row, :len(prompts[n])] >= 0).all()
        if shared:
            assert batch.policy.row_prefix[p.row] is not None
    got, _ = drive(row_batch(model, "full", max_batch=3, chunk=64, prefill_batch=3), prompts,
                   dict.fromkeys(prompts, 0), staged=True)
    ref, _ = drive(row_batch(model, "full", max_batch=3, chunk=64), prompts, dict.fromkeys(prompts, 0), staged=True)
    for n in prompts:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


def test_a_request_cancelled_mid_group_leaves_the_others_their_rows(model):  # noqa: F811
    """Three prompts prefilled together in chunks of 16; the middle one is cancelled after the first chunk: the
    other two go on in their scratch rows and join with the logits they get prefilled alone (each its own scratch
    row's, not a neighbour's)."""
    prompts = prompts_of({"a": 40, "b": 25, "c": 33})
    batch = row_batch(model, "full", max_batch=3, chunk=16, prefill_batch=3)
    started = {n: batch.start(ids) for n, ids in prompts.items()}
    with torch.inference_mode():
        assert batch.advance() == []
        batch.cancel(started["b"])
        joined = {}
        while batch.pending:
            joined.update(batch.advance())
    assert sorted(joined) == sorted([started["a"].row, started["c"].row]) and not batch.holds(started["b"])
    ref = row_batch(model, "full", max_batch=3, chunk=16).admit([prompts["a"], prompts["c"]])
    for (_, logits), n in zip(ref, "ac"):
        torch.testing.assert_close(joined[started[n].row], logits, atol=1e-5, rtol=1e-5)
        assert int(batch.policy.length[started[n].row]) == len(prompts[n])


def test_a_failed_group_is_prefilled_again_one_prompt_at_a_time(model):  # noqa: F811
    """A prefill chunk of three prompts together fails (a fault in the middle one): none is dropped; each is then
    prefilled alone, the faulty one fails alone (dropped, re-raised), the other two join with the logits they get
    prefilled alone."""
    prompts = prompts_of({"a": 40, "b": 25, "c": 33})
    batch = row_batch(model, "full", max_batch=3, chunk=64, prefill_batch=3)       # (one chunk a prompt)
    prefill, calls = batch.prefill, []

    def faulty(m, tokens, *a):
        calls.append(tokens.shape[0])
        if any(row[-5:].tolist() == prompts["b"][-5:] for row in tokens):
            raise RuntimeError("fault")
        return prefill(m, tokens, *a)
    batch.prefill = faulty
    started = {n: batch.start(ids) for n, ids in prompts.items()}
    with pytest.raises(RuntimeError, match="fault"):
        batch.advance()
    assert all(batch.holds(p) for p in started.values()) and calls == [3]
    joined = dict(batch.advance())                                      # a, alone
    with pytest.raises(RuntimeError, match="fault"):
        batch.advance()                                                 # b, alone: dropped
    joined.update(batch.advance())                                      # c, alone
    assert calls == [3, 1, 1, 1] and not batch.holds(started["b"]) and not batch.pending
    ref = row_batch(model, "full", max_batch=3, chunk=64).admit([prompts["a"], prompts["c"]])
    for (row, logits), n in zip(ref, "ac"):
        torch.testing.assert_close(joined[started[n].row], logits, atol=1e-5, rtol=1e-5)


def test_compressing_policy_keeps_no_prefix(model):  # noqa: F811
    """snapkv compresses each prompt as a whole, so it cannot continue a kept prefix exactly: no reuse, said
    so, and the answers are those without it."""
    prompts = prompts_of({"q1": 12, "q2": 20}, shared=150)
    batch = row_batch(model, "snapkv", prefix_bytes=1 << 30)
    assert batch.prefixes is None and "prefix_reuse" in batch.reuse_off
    got, _ = drive(batch, prompts, dict.fromkeys(prompts, 0), staged=True)
    ref, _ = drive(row_batch(model, "snapkv"), prompts, dict.fromkeys(prompts, 0), staged=False)
    for n in prompts:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["snapkv:budget=40,obs_window=8", "h2o:budget=40",
                                  "snapkv+quest:budget=128,n_critical=96"])
def test_agnostic_reuse_compresses_a_shared_prefix_once(model, spec):  # noqa: F811
    """agnostic=True, a compressing policy (an evicting one, a reader): a request decoding (its own prompt,
    aware) while three questions on one 150-token document arrive together: the first's admission compresses
    the document alone (the boundary it shares with the waiting others), all three adopt it and append their
    question one decode step each alongside the other rows; each question's logits equal those of its question
    appended to the compressed document alone (context_rows + prefill_rows + append_tokens), the lone
    request's those without reuse."""
    room = NEW + 24
    prompts = {"solo": prompts_of({"solo": 60}, seed=2)["solo"],
               **prompts_of({"q1": 12, "q2": 20, "q3": 7}, shared=150)}
    arrivals = {"solo": 0, "q1": 2, "q2": 2, "q3": 2}
    batch = RowBatch(model, lambda: make_policy(spec), 4, 400 + room, room, prefix_bytes=1 << 30,
                     min_prefix=16, agnostic=True)
    got, _ = drive(batch, prompts, arrivals, staged=True, new_tokens=NEW)
    ref, _ = drive(RowBatch(model, lambda: make_policy(spec), 4, 400 + room, room), {"solo": prompts["solo"]},
                   {"solo": 0}, staged=True)
    torch.testing.assert_close(got["solo"], ref["solo"], atol=1e-5, rtol=1e-5)
    stats = batch.prefixes.stats()
    assert (stats["hits"], stats["reused_tokens"], stats["entries"]) == (2, 300, 1), stats
    with torch.inference_mode():
        for n in ("q1", "q2", "q3"):
            context = context_rows(model, lambda: make_policy(spec), room, 400 + room)
            prefill_rows(model, prompts[n][:150], 1024)
            context_rows(model, lambda: make_policy(spec), room, 400 + room).adopt(0, context)
            logits = [append_tokens(model, prompts[n][150:], 150)[0]]
            for i in range(NEW - 1):
                token = logits[-1].argmax()[None, None]
                pos = torch.tensor([[len(prompts[n]) + i]])
                logits.append(run_decode(model, token, pos, len(prompts[n]) - 150 + i)[0])
            torch.testing.assert_close(got[n], torch.stack(logits), atol=1e-5, rtol=1e-5)


def test_a_question_longer_than_max_question_is_compressed_with_its_prompt(model):  # noqa: F811
    """agnostic=True, max_question=10: of three questions on one shared 150-token document, the 7-token one
    appends to the document compressed alone (agnostic); the 12- and 20-token ones, which would hold back their
    first token that many decode steps, are compressed with their prompt (aware)."""
    prompts = prompts_of({"q1": 12, "q2": 20, "q3": 7}, shared=150)
    room = NEW + 24
    batch = RowBatch(model, lambda: make_policy("snapkv:budget=40,obs_window=8"), 4, 400 + room, room,
                     prefix_bytes=1 << 30, min_prefix=16, agnostic=True, max_question=10)
    with torch.inference_mode():
        started = {n: batch.start(ids, new_tokens=NEW) for n, ids in prompts.items()}
        while batch.pending:
            batch.advance()
    assert {n: p.protocol for n, p in started.items()} == {"q1": "aware", "q2": "aware", "q3": "agnostic"}
    assert batch.prefixes.stats()["entries"] == 1
    with pytest.raises(ValueError, match="max_question"):
        RowBatch(model, lambda: make_policy("snapkv"), 4, 400, 16, max_question=0)


def test_prefix_cache_is_a_byte_bounded_lru():
    cache = PrefixCache(max_bytes=100, min_tokens=3)
    assert cache.insert((1, 2, 3), "a", 40) and cache.insert((1, 2, 3, 4, 5), "b", 40)
    assert cache.lookup([1, 2, 3, 4, 5, 6]) == (5, "b")           # the longest kept prefix
    assert cache.lookup([1, 2, 3, 4, 5]) == (3, "a")              # never the whole prompt
    assert cache.lookup([9, 1, 2, 3]) == (0, None)
    assert cache.insert((7, 7, 7), "c", 40)                        # drops the least recently used: (1,2,3,4,5)
    assert list(cache.entries) == [(1, 2, 3), (7, 7, 7)] and cache.bytes == 80 and cache.evictions == 1
    assert not cache.insert((8, 8, 8), "too big", 101) and cache.bytes == 80
    assert (cache.hits, cache.misses, cache.reused_tokens) == (2, 1, 8)


def test_prefix_boundaries():
    cache = PrefixCache(max_bytes=100, min_tokens=3)
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2 and common_prefix([], [1]) == 0
    assert cache.boundary([1, 2, 3, 4, 9]) == 0                    # nothing seen yet
    assert cache.boundary([1, 2, 3, 4, 8]) == 4                    # shares 4 tokens with the first
    assert cache.boundary([5, 6, 7, 8, 9], waiting=[[5, 6, 7, 8, 1]]) == 4      # shares 4 with a waiting one
    assert cache.boundary([1, 2, 3, 4]) == 3                       # at least the last token is prefilled
    assert cache.boundary([1, 2, 9, 9]) == 0                       # 2 shared tokens: under min_tokens
    assert cache.boundary([4, 4, 4, 4], prefix_len=2) == 2         # explicit
    many = PrefixCache(max_bytes=100, min_tokens=2)
    for other in ([1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 7, 0], [1, 2, 8], [1, 2, 9]):
        many.boundary(other)
    assert many.boundary([1, 2, 3, 4, 5, 6, 1]) == 5      # 5 x 2 prompts beat 6 x 1 and 2 x 4
    assert many.boundary([1, 2, 7, 7]) == 2
    cache.insert((1, 2, 3, 4), "a", 10)
    assert cache.boundary([1, 2, 3, 4, 7]) == 0                    # already kept


def test_a_request_arriving_mid_prefill_has_the_shared_prefix_snapshotted(model):  # noqa: F811
    """Questions on one document arriving one by one (as a server's do): the first prompt's prefill has begun,
    with no other request waiting, when the second starts; the prefill then snapshots the 150 tokens they share
    (not yet prefilled), so the second prefills only its question, with the same logits as without reuse."""
    prompts = prompts_of({"q1": 12, "q2": 20, "q3": 9}, shared=150)
    batch = row_batch(model, "full", max_batch=3, prefix_bytes=1 << 30, min_prefix=16)
    with torch.inference_mode():
        first = batch.start(prompts["q1"])
        batch.advance()                                         # chunk 1 of q1: it shares nothing yet
        assert first.started and first.snapshot_at == 0 and first.done == 32
        batch.start(prompts["q2"])
        assert first.snapshot_at == 150
        done = dict(batch.advance())
        while len(done) < 2:
            done.update(batch.advance())
        batch.start(prompts["q3"])                              # after q2: from the kept prefix, no new snapshot
        while len(done) < 3:
            done.update(batch.advance())
    assert batch.prefill_tokens == sum(map(len, prompts.values())) - 2 * 150
    assert len(batch.prefixes.entries) == 1
    plain = row_batch(model, "full", max_batch=3)
    with torch.inference_mode():
        ref = dict(plain.admit(list(prompts.values())))
    for row in ref:
        torch.testing.assert_close(done[row], ref[row], atol=1e-5, rtol=1e-5)
