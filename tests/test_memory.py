"""Admission by KV memory (runtime/memory.py, RowBatch(kv_memory=), serve.py --kv-memory): rows from bytes per
policy, full's rows sized to the requests, per-layer storage, refcounted shared prefixes, /health and /metrics."""
from __future__ import annotations

import pytest
import torch

from cache import make_policy
from runtime.memory import SIZE_STEP, parse_size, row_bytes, rows_that_fit, size_class
from runtime.prefix_cache import PrefixCache
from runtime.rows import RowBatch
from runtime.steps import UsageError
from tests.test_policy_matrix import ARGS, model  # noqa: F401  (model: the tiny Llama fixture)
from tests.test_rowbatch import NEW, drive, prompts_of
from tests.test_shared_prefix import head64_model, needs_kernels

S = 2048                                    # max_seq_length of the tests' batches (ARGS' context)
TOKEN = ARGS.n_layers * 2 * ARGS.n_kv_heads * ARGS.head_dim * 4      # bytes of one token of one row, float32


@pytest.mark.parametrize("text, size", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29),
                                        ("300MB", 300_000_000), ("4096", 4096), (" 64 kib ", 64 << 10)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1G", "0", "2XB", "", "1e9", "0.1"])
def test_parse_size_refuses_bad_input(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("spec, slots", [("full", S), ("snapkv:budget=256", 256 + NEW), ("h2o:budget=256", 256),
                                         ("streaming:budget=64", 64), ("snapkv:ratio=0.5", S // 2 + NEW),
                                         ("simlayerkv", S)])
def test_rows_from_memory_per_policy(model, spec, slots):  # noqa: F811
    """A row costs its slots (budget + decode room where the layer appends; an evicting layer its budget; full and
    simlayerkv before it finds lazy layers: every position) x a token's K/V bytes; rows = memory // that, at most
    max_batch; a RowBatch with that memory holds that many rows, and allocates no more than the memory."""
    make = lambda: make_policy(spec)          # noqa: E731
    cost = row_bytes(model, make, S, NEW)
    assert cost == slots * TOKEN
    memory = 5 * cost + cost // 2
    assert rows_that_fit(model, make, memory, 8, S, NEW) == 5 and rows_that_fit(model, make, memory, 3, S, NEW) == 3
    if spec != "full":                          # (full's rows are sized to the requests: below)
        batch = RowBatch(model, make, 8, S, NEW, kv_memory=memory)
        assert batch.max_batch == batch.batch_size == 5 and batch.room == 5
        assert batch.policy.kv_bytes()["allocated"] <= memory


def test_too_little_memory_is_a_clear_error(model):  # noqa: F811
    with pytest.raises(ValueError, match="hold no row of policy 'snapkv'"):
        RowBatch(model, lambda: make_policy("snapkv:budget=256"), 8, S, NEW, kv_memory=1000)


def admitted(batch: RowBatch, prompt: int, new: int) -> int:
    """Requests of `prompt` tokens (+ `new`) started in the batch until it says no more fit now."""
    n = 0
    while batch.can_start(prompt + new) and n < 1000:
        batch.start([1] * prompt, new_tokens=new)
        n += 1
    return n


def test_a_compressing_policy_runs_3x_full_rows_at_equal_memory(model):  # noqa: F811
    """1.5k-token prompts + 128 new tokens, the same kv_memory: snapkv (budget 256) admits >= 3x full's rows
    (full: rows sized to the requests, a 1792-token class; snapkv: 256 + 128 slots)."""
    memory, new = 12 * S * TOKEN, 128
    full = RowBatch(model, lambda: make_policy("full"), 64, S, new, kv_memory=memory)
    snap = RowBatch(model, lambda: make_policy("snapkv:budget=256"), 64, S, new, kv_memory=memory)
    n_full, n_snap = admitted(full, 1536, new), admitted(snap, 1536, new)
    assert full.policy.capacity == size_class(1536 + new, S) == 1792
    assert n_full == memory // (1792 * TOKEN) == 13 and n_snap == memory // (384 * TOKEN) == 64
    assert n_snap >= 3 * n_full
    assert full.policy.kv_bytes()["allocated"] <= memory and snap.policy.kv_bytes()["allocated"] <= memory


def test_full_rows_sized_to_requests_admit_more_short_ones(model):  # noqa: F811
    """At the memory of 4 rows of max_seq_length, short requests (100 + 28 tokens, one 256-token class) take 32
    rows where reserving max_seq_length for each would take 4; a long one then waits until its shape fits."""
    memory = 4 * S * TOKEN
    batch = RowBatch(model, lambda: make_policy("full"), 64, S, NEW, kv_memory=memory)
    assert admitted(batch, 100, 28) == 32 == memory // (SIZE_STEP * TOKEN)
    assert batch.policy.capacity == SIZE_STEP and batch.batch_size == 32
    assert not batch.can_start(1900 + 100)                 # 2048 tokens: 4 rows, but rows 0..31 are held
    assert not batch.never_fits(2000)
    with pytest.raises(ValueError, match="needs more than the kv_memory"):
        RowBatch(model, lambda: make_policy("full"), 64, S, NEW, kv_memory=SIZE_STEP * TOKEN).start([1] * 300)


def test_sized_full_rows_reshape_without_changing_greedy_outputs(model):  # noqa: F811
    """Short requests run in small rows, a long one arrives: the batch waits for the bytes, then moves its rows
    into longer ones (take_rows) between steps; every request's logits equal those of plain full rows."""
    prompts = prompts_of({"s1": 20, "s2": 30, "s3": 12, "long": 300, "s4": 25})
    arrivals = {"s1": 0, "s2": 0, "s3": 1, "long": 3, "s4": 4}
    shapes = []
    memory = 6 * SIZE_STEP * TOKEN                          # 6 rows of 256 slots, or 3 of 416 (max_seq_length)
    batch = RowBatch(model, lambda: make_policy("full"), 8, 400 + NEW, NEW, prefill_chunk=32, kv_memory=memory)
    step = batch.step

    def watched(tokens):
        shapes.append((batch.batch_size, batch.policy.capacity))
        return step(tokens)
    batch.step = watched
    got, _ = drive(batch, prompts, arrivals, staged=True)
    ref, _ = drive(RowBatch(model, lambda: make_policy("full"), 8, 400 + NEW, NEW, prefill_chunk=32), prompts,
                   arrivals, staged=True)
    assert (6, 256) in shapes and (3, 416) in shapes, shapes
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), n
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["pyramidkv:budget=96", "d2o:budget=96"])
def test_per_layer_budgets_hold_their_layers_bytes(model, spec):  # noqa: F811
    """Each layer's storage holds its own budget (+ decode room where it appends), not the largest layer's; the
    row cost is their sum."""
    batch = RowBatch(model, lambda: make_policy(spec), 2, 400 + NEW, NEW)
    drive(batch, prompts_of({"a": 300, "b": 280}), {"a": 0, "b": 0}, staged=True)
    policy = batch.policy
    per_layer = [policy.slots.nbytes(layer) for layer in range(ARGS.n_layers)]
    room = [NEW if policy.layer_appends[layer] else 0 for layer in range(ARGS.n_layers)]
    assert per_layer == [2 * (b + r) * TOKEN // ARGS.n_layers for b, r in zip(policy.budgets, room)]
    if spec.startswith("pyramidkv"):
        assert len(set(policy.budgets)) > 1, policy.budgets            # the schedule gives layers their own


def test_prefix_cache_keeps_referenced_prefixes():
    """A prefix rows read in place is never dropped: the LRU drops the next unreferenced one, refuses a new one
    that would need it, and drops it once the last row lets go."""
    cache = PrefixCache(100, min_tokens=1)
    a, b, c, d = object(), object(), object(), object()
    assert cache.insert((1,), a, 40) and cache.insert((2,), b, 40)
    cache.acquire(a)
    cache.acquire(a)
    assert cache.insert((3,), c, 40)                    # drops b (older a is referenced)
    assert list(cache.entries) == [(1,), (3,)] and cache.stats()["referenced"] == 1
    assert not cache.evict((1,)) and not cache.insert((4,), d, 70)     # only c could go: not enough
    cache.drop(a)
    assert not cache.evict((1,))
    cache.drop(a)
    assert cache.evict((1,)) and cache.bytes == 40
    with pytest.raises(ValueError):
        cache.drop(a)


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["cpp", "twin"])
def test_two_prefixes_read_in_place_with_references(model, kernels):  # noqa: F811
    """Two documents at once: rows on each read their kept prefix in place (two groups; kvc::prefix_attention or
    its twin once per prefix), the cache counts both as referenced while rows read them (none after), and every
    request decodes what it decodes with copies."""
    model = head64_model() if kernels else model
    a = prompts_of({"a1": 10, "a2": 12, "a3": 8}, seed=1, shared=120)
    b = prompts_of({"b1": 9, "b2": 14, "b3": 11}, seed=2, shared=100)
    prompts = {"a1": a["a1"], "b1": b["b1"], "a2": a["a2"], "b2": b["b2"], "a3": a["a3"], "b3": b["b3"]}
    seen = []
    batch = RowBatch(model, lambda: make_policy("full"), 4, 400 + NEW, NEW, prefill_chunk=32,
                     prefix_bytes=1 << 30, min_prefix=16)
    step = batch.step

    def watched(tokens):
        seen.append((len(batch.policy.groups), batch.prefixes.stats()["referenced"],
                     sorted(p.n_filled for p in set(batch.policy.row_prefix) if p is not None)))
        return step(tokens)
    batch.step = watched
    got, _ = drive(batch, prompts, dict.fromkeys(prompts, 0), staged=True)
    ref, _ = drive(RowBatch(model, lambda: make_policy("full"), 4, 400 + NEW, NEW, prefill_chunk=32), prompts,
                   dict.fromkeys(prompts, 0), staged=True)
    assert (2, 2, [100, 120]) in seen, seen
    assert not batch.policy.groups and batch.prefixes.stats()["referenced"] == 0 and not batch.prefixes.refs
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), n
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


def test_server_reports_memory_per_policy(tiny_dir):
    """--kv-memory split in equal shares: /health and /metrics give each policy's share, rows, reserved and used
    bytes; a bad size is a usage error."""
    from server.app import build_engine, build_parser
    from tests.test_serve import complete, metrics, running
    with pytest.raises(UsageError, match="--kv-memory"):
        build_engine(build_parser().parse_args(["--checkpoint", str(tiny_dir), "--kv-memory", "lots"]))
    flags = ["--policies", "full; snapkv:budget=32", "--kv-memory", "4MiB", "--max-batch", "64",
             "--max-new-tokens-limit", "16", "--max-seq-length", "256", "--prefix-cache-mb", "0"]
    with running(tiny_dir, *flags) as (client, srv):
        assert complete(client, "Hello", 4)["kv_policy"] == "full"
        health = client.get("/health").json()
        got = metrics(client)
    assert health["kv_memory"] == 4 << 20
    for name, lane in srv.lanes.items():
        p = health["policies"][name]
        assert p["kv_memory"] == 2 << 20 and p["rows_active"] == 0
        assert p["rows_total"] == lane.batch.batch_size and 0 < p["kv_bytes_reserved"] <= 2 << 20
        one = frozenset({"policy": name}.items())
        assert got["kvserve_kv_memory_bytes", one] == 2 << 20 and got["kvserve_rows_max", one] == p["rows_total"]
        assert got["kvserve_kv_allocated_bytes", one] == p["kv_bytes_reserved"]
    cost = row_bytes(srv.model, srv.lanes["snapkv"].make_policy, 256, 16)
    assert health["policies"]["snapkv"]["rows_total"] == min(64, (2 << 20) // cost)
    assert health["policies"]["full"]["row_capacity"] == SIZE_STEP


def test_server_requests_wait_for_memory(tiny_dir):
    """--kv-memory for one 256-token row of full (3 layers x 2 KV heads x 64 x 4 bytes x 2 = 3 KiB a token): three
    concurrent requests all succeed (200, no 429), one at a time, each with the text it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_serve import complete, running
    flags = ["--kv-memory", "768KiB", "--max-batch", "8", "--max-new-tokens-limit", "16", "--max-seq-length", "256",
             "--prefix-cache-mb", "0"]
    prompts = ["Hello there", "The capital of France", "One two three four"]
    with running(tiny_dir, *flags) as (client, srv):
        assert client.get("/health").json()["policies"]["full"]["rows_total"] == 1
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda p: complete(client, p, 12)["choices"][0]["text"], prompts))
        alone = [complete(client, p, 12)["choices"][0]["text"] for p in prompts]
        assert srv.http[200] == 6 and srv.lanes["full"].batch.batch_size == 1
    assert together == alone
