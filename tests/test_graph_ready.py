"""Graph-readiness of the decode step, for every registered policy x KV storage (the cells are made from the
registry, as in test_policy_matrix.py; KIVI 4-bit stands for both packed formats; EXTRA adds specs whose decode
runs code the defaults skip here): what a CUDA graph needs, checked on the CPU.

  - the static step (runtime/steps.py static_decode_step through GraphDecode, the one a CUDA graph replays)
    compiles with fullgraph=True (no graph break) and runs STEPS steps after the prompt with no recompile after
    its warm-up (dynamo's own tracing, backend="eager": graph breaks and recompiles are decided there; Inductor's
    code is compared with eager elsewhere, test_policies.py and test_model.py), and each graph it captures would
    replay as one CUDA graph (graph_blockers: static inputs, no control flow, no data-dependent sizes);
  - the dynamic step (CPU --compile's) compiles whole too, at 16 bits;
  - both steps make no host synchronization: Tensor.item, tolist, __bool__, __int__, __float__ and nonzero
    raise inside them (the host hooks before the step run outside it, and may), and the static step gives the
    dynamic step's logits;
  - `full`'s static step passes one int, the read bound, that stays the same inside a bucket; rows that join
    and leave (RowBatch) and rows reading a kept prefix in place take it too.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from cache import POLICIES, PolicyError, make_policy
from cache.quantized import with_kv_bits
from model import ModelArgs
from cache.full import read_bound
from runtime.stats import format_graphs
from runtime.steps import (GraphDecode, decode_step, graph_report, prefill_step, run_decode, run_prefill,
                           static_decode_step, warm_up)
from tests.helpers import fresh_compiles, left_padded, random_llama

ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                 max_position_embeddings=2048)     # 2 layers: a second layer's code (sharing, lazy layers) traced
# 16-bit and KIVI 4-bit: KIVI 2-bit runs 4-bit's code with other constants (test_policy_matrix.py runs its steps);
# tracing a cell costs 2-12 s at 16 bits and 10-50 s over KIVI (dynamo's symbolic shapes), so 2-bit is left out
STORAGES = {"kv16": 16, "kv4": 4}
LENGTHS = [600, 420]            # two rows, left-padded, longer than every default budget
STEPS = 200
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero")


def policy_for(name: str, bits: int):
    """The policy at its defaults over `bits` storage (KIVI G 8, R 16), or None where it has no such storage."""
    try:
        return with_kv_bits(make_policy(name), bits, 8, 16)
    except (ValueError, PolicyError):
        return None


# specs whose decode runs code the defaults skip on ARGS' 2 layers x 2 KV heads: HShare's layer and head sharing
EXTRA = [("hshare:ratios=1/2-1/2-1/2", "kv16")]


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        cells = [(n, s) for n in sorted(POLICIES) for s, bits in STORAGES.items() if policy_for(n, bits) is not None]
        cells += EXTRA
        metafunc.parametrize("cell", cells, ids=[f"{n}-{s}" for n, s in cells])
    if "cell16" in metafunc.fixturenames:
        cells = [(n, "kv16") for n in sorted(POLICIES)] + [c for c in EXTRA if c[1] == "kv16"]
        metafunc.parametrize("cell16", cells, ids=[f"{n}-{s}" for n, s in cells])


@pytest.fixture(scope="module")
def model():
    return random_llama(ARGS)


def decode_run(model, policy, step, steps: int, on_step=None, capacity=None) -> torch.Tensor:
    """Prefill LENGTHS under `policy`, then `steps` decode steps through `step` -> logits [steps, B, V].
    capacity: the cache's max_seq_length (default: just enough, 8 to spare)."""
    device = model.output.weight.device         # (tests/test_gpu.py runs it on CUDA)
    out = []
    model.setup_caches(len(LENGTHS), capacity or max(LENGTHS) + steps + 8, policy)  # as engine.generate: cache,
    with torch.inference_mode():                                            # then inference tensors
        tokens, pos = (t.to(device) for t in left_padded(LENGTHS, vocab=ARGS.vocab_size))
        follow = torch.randint(0, ARGS.vocab_size, (len(LENGTHS), steps), generator=torch.Generator().manual_seed(1))
        follow = follow.to(device)
        run_prefill(model, tokens, pos)
        for s in range(steps):
            out.append(run_decode(model, follow[:, s:s + 1].contiguous(), pos[:, -1:] + 1 + s, s, step))
            if on_step:
                on_step(s)
    return torch.stack(out)


@contextlib.contextmanager
def host_syncs_raise():
    """Inside: reading a tensor's value on the host raises (SYNCS)."""
    def refuse(*args, **kwargs):
        raise AssertionError("host synchronization inside the decode step")
    saved = {name: getattr(torch.Tensor, name) for name in SYNCS}
    for name in SYNCS:
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


def graph_blockers(seen: list):
    """A dynamo backend (runs the graph eagerly) that appends to `seen` what would keep a captured graph from
    replaying as one CUDA graph (torch/_inductor's cudagraph checks): every tensor input not at a static address,
    apart from the step's token and positions (a CUDA graph copies such an input in at every replay, and
    cudagraph trees skip a graph that writes one in place; empty tensors, the CPU kernels' placeholders for absent
    arguments, have nothing to copy), control flow (torch.cond, while_loop: Inductor disables cudagraphs) and
    data-dependent sizes (unbacked symbols)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def backend(gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        seen.extend(f"input {name} not static" for name, t in zip(names, example_inputs)
                    if isinstance(t, torch.Tensor) and t.numel() and name not in ("l_token_", "l_input_pos_")
                    and getattr(t, "_dynamo_static_input_type", None) is None)
        for node in gm.graph.nodes:
            if node.target in (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop):
                seen.append(f"control flow {node.name}")
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and free_unbacked_symbols(value):
                seen.append(f"data-dependent size {node.name}")
        return gm.forward
    return backend


def test_decode_compiles_whole_without_recompiles(model, cell):
    """GraphDecode over the static step where the policy has one (else the dynamic step), each compiled with
    fullgraph=True (a graph break raises): unique_graphs after warm-up (step 4) never grows, and the static step's
    graph would replay as one CUDA graph (graph_blockers)."""
    name, storage = cell
    policy = policy_for(name, STORAGES[storage])
    counters, seen = fresh_compiles(), {}
    moving = []
    with torch._dynamo.config.patch(specialize_float=True):      # as compiled_steps
        graph = GraphDecode(torch.compile(static_decode_step, dynamic=True, fullgraph=True,
                                          backend=graph_blockers(moving)),
                            torch.compile(decode_step, dynamic=True, fullgraph=True, backend="eager"))

        def count(s):
            if s == 3:
                seen["warm"] = counters["stats"]["unique_graphs"]
        # room past the last read bound: a bound clipped to the capacity is another graph (a slice of the whole buffer)
        decode_run(model, policy, graph, STEPS, count, capacity=max(LENGTHS) + STEPS + 72)
    assert counters["stats"]["unique_graphs"] == seen["warm"], f"{name} over {storage} recompiled in decode"
    assert (graph.static_steps == STEPS) == policy.static_decode, graph.report()
    assert not moving, f"{name} over {storage}: the static step would not replay as one CUDA graph: {moving}"


def test_dynamic_decode_compiles_whole_without_recompiles(model, cell16):
    """The dynamic step too (CPU --compile's, and CUDA's for a cache without a static step), fullgraph=True, 40 steps:
    no recompile after warm-up.  16-bit cells only: the decode hooks are the static step's (above), the dynamic
    `begin` of KIVI storage compiles in test_policies.py and test_kivi_kernels.py (a KIVI trace costs 8-21 s)."""
    name, storage = cell16
    counters, seen = fresh_compiles(), {}
    step = torch.compile(decode_step, dynamic=True, fullgraph=True, backend="eager")

    def count(s):
        if s == 3:
            seen["warm"] = counters["stats"]["unique_graphs"]
    decode_run(model, policy_for(name, STORAGES[storage]), step, 40, count)
    assert counters["stats"]["unique_graphs"] == seen["warm"], f"{name}'s dynamic step recompiled in decode"


def no_sync(step):
    """`step`, run with host syncs raising inside it (host_syncs_raise)."""
    def call(*args):
        with host_syncs_raise():
            return step(*args)
    return call


def test_static_step_equals_the_dynamic_step_and_makes_no_host_sync(model, cell):
    """Eager, 60 steps, each made with host syncs raising inside the step (the host hooks before it may sync): the
    static step (where the policy has one) gives the dynamic step's logits; a policy without one takes the dynamic
    step, and GraphDecode names it."""
    name, storage = cell
    dynamic = decode_run(model, policy_for(name, STORAGES[storage]), no_sync(decode_step), 60)
    policy = policy_for(name, STORAGES[storage])
    graph = GraphDecode(no_sync(static_decode_step), no_sync(decode_step))
    static = decode_run(model, policy, graph, 60)
    torch.testing.assert_close(static, dynamic, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(static).all()
    assert graph.static_steps == (60 if policy.static_decode else 0)
    assert bool(graph.dynamic_caches) != policy.static_decode


def test_host_syncs_raise_catches_a_sync():
    """The guard is live: a step that reads a value on the host fails under it."""
    with host_syncs_raise(), pytest.raises(AssertionError, match="host synchronization"):
        torch.ones(2).sum().item()
    assert torch.ones(2).sum().item() == 2.0


# --------------------------------------------------------------------------- the static step (CUDA graphs)

def recording(step, reads: list):
    """`step` (static_decode_step's signature), recording each call's read bound in `reads`."""
    def call(model, token, input_pos, n_read):
        reads.append((model.cache.n_filled, n_read))
        return step(model, token, input_pos, n_read)
    return call


def test_read_bound_buckets():
    """At least n, at most 64 or ~3% more, never past capacity, and few distinct bounds."""
    bounds = [read_bound(n, 10**6) for n in range(1, 40000)]
    for n, b in enumerate(bounds, 1):
        assert n <= b <= n + max(63, n // 32 + 1), (n, b)
    assert bounds == sorted(bounds)
    assert len(set(bounds)) < 200                         # 32 per doubling past 2048
    assert read_bound(700, 650) == 650


def test_static_step_equals_the_dynamic_step_and_reads_buckets(model):
    """`full` over GraphDecode's static step (eager): the dynamic step's logits, every read bound a bucket
    at or past the tokens held, each bound kept for many steps."""
    dynamic = decode_run(model, make_policy("full"), decode_step, STEPS)
    reads = []
    static = decode_run(model, make_policy("full"), GraphDecode(recording(static_decode_step, reads), decode_step),
                        STEPS)
    torch.testing.assert_close(static, dynamic, atol=1e-5, rtol=1e-5)     # (masked slots: another summation order)
    assert len(reads) == STEPS
    capacity = max(LENGTHS) + STEPS + 8                   # decode_run's max_seq_length
    assert all(bound == read_bound(n, capacity) for n, bound in reads)
    assert len({bound for _, bound in reads}) <= 4        # 600..800 tokens: buckets of 64


def test_static_step_compiles_once_for_every_bucket(model):
    """fullgraph=True, dynamic: one graph serves every bucket below the capacity (a CUDA graph is then captured
    per bucket, and replayed inside it)."""
    counters = fresh_compiles()
    reads = []
    step = torch.compile(static_decode_step, dynamic=True, fullgraph=True, backend="eager")
    graph = GraphDecode(recording(step, reads), decode_step)
    tokens, pos = left_padded(LENGTHS, vocab=ARGS.vocab_size)
    with torch.inference_mode():
        model.setup_caches(len(LENGTHS), 2 * max(LENGTHS), make_policy("full"))
        run_prefill(model, tokens, pos)
        for s in range(STEPS):
            run_decode(model, tokens[:, s:s + 1], pos[:, -1:] + 1 + s, s, graph)
    assert counters["stats"]["unique_graphs"] == 1
    assert len({bound for _, bound in reads}) == 4 and not graph.dynamic_caches


@pytest.mark.parametrize("name", ["full", "snapkv", "h2o"])
def test_rows_that_join_and_leave_take_the_static_step(model, name):
    """RowBatch's rows (admitted, released, prompts of other lengths) over GraphDecode's static step: the dynamic
    step's logits (an appending and an evicting policy beside `full`)."""
    from tests.test_rowbatch import drive, prompts_of, row_batch
    prompts = prompts_of({0: 90, 1: 40, 2: 130, 3: 70})
    arrivals = {0: 0, 1: 0, 2: 3, 3: 9}
    want, _ = drive(row_batch(model, name, share_prefix=False), prompts, arrivals, staged=True)
    graph = GraphDecode(static_decode_step, decode_step)
    got, _ = drive(row_batch(model, name, share_prefix=False, decode=graph), prompts, arrivals, staged=True)
    for n in prompts:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-5)
    assert not graph.dynamic_caches and graph.static_steps > 0


def test_rows_reading_a_prefix_in_place_take_the_static_step(model):
    """Rows reading a kept prefix in place (its buffers and the rows' prefix bookkeeping marked static; its length a
    shape, fixed while it is kept): the static step throughout, with the dynamic step's logits."""
    from tests.test_rowbatch import drive, prompts_of, row_batch
    prompts = prompts_of({0: 40, 1: 30, 2: 50}, shared=64)
    arrivals = {0: 0, 1: 20, 2: 21}
    want, _ = drive(row_batch(model, "full", prefix_bytes=1 << 24), prompts, arrivals, staged=True)
    groups = []

    def step(model, *args):
        groups.append(len(model.cache.groups))
        return static_decode_step(model, *args)
    graph = GraphDecode(step, decode_step)
    got, _ = drive(row_batch(model, "full", prefix_bytes=1 << 24, decode=graph), prompts, arrivals, staged=True)
    for n in prompts:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-5)
    assert max(groups) >= 1, "no row read a prefix in place"
    assert graph.static_steps > 0 and graph.dynamic_steps == 0


def test_graph_report_names_the_caches_without_a_static_step(model):
    """A cache without a static step (model.py's plain DenseCache) takes the dynamic step; the stats line says so."""
    graph = GraphDecode(static_decode_step, decode_step)
    tokens, pos = left_padded(LENGTHS, vocab=ARGS.vocab_size)
    with torch.inference_mode():
        for policy in (None, make_policy("full")):
            model.setup_caches(len(LENGTHS), 700, policy)
            run_prefill(model, tokens, pos)
            for s in range(3):
                run_decode(model, tokens[:, s:s + 1], pos[:, -1:] + 1 + s, s, graph)
    report = graph_report(graph)
    assert (report["static_steps"], report["dynamic_steps"], report["graphs"]) == (3, 3, 1)
    assert format_graphs(report) == (" | CUDA graphs 1 (batch x bucket), 3 static steps, 3 dynamic (DenseCache "
                                     "(dense storage): no static step)")
    assert graph_report(decode_step) is None and format_graphs(None) == ""


def test_a_warmed_up_static_step_serves_a_longer_request(model):
    """runtime.steps.warm_up leaves room past its read bound, so the graph it compiles serves a real request whose
    buckets stay below its capacity (a warm-up reading its whole buffer would specialize the slice, and such a
    request would recompile; a request whose last bucket is clipped to its capacity compiles that variant once)."""
    counters = fresh_compiles()
    graph = GraphDecode(torch.compile(static_decode_step, dynamic=True, fullgraph=True, backend="eager"), decode_step)
    tokens, _ = left_padded(LENGTHS, vocab=ARGS.vocab_size)
    warm_up(model, prefill_step, graph, tokens[:, -4:].clone())
    warm = counters["stats"]["unique_graphs"]
    decode_run(model, make_policy("full"), graph, 20, capacity=700)
    assert counters["stats"]["unique_graphs"] == warm == 1


@pytest.mark.parametrize("name", ["full", "snapkv", "ds"])
def test_compiled_static_step_over_rows_that_join_and_leave(model, name):
    """RowBatch over the compiled static step (fullgraph=True): rows join and leave, `full`'s rows read a kept
    prefix in place: every buffer at a static address, the eager dynamic step's logits, and few graphs (a graph
    per number of prefixes read and per bucket shape, never per step)."""
    from tests.test_rowbatch import drive, prompts_of, row_batch
    prompts = prompts_of({0: 40, 1: 30, 2: 50}, shared=64)
    arrivals = {0: 0, 1: 20, 2: 21}
    kw = {"prefix_bytes": 1 << 24} if name == "full" else {}
    want, _ = drive(row_batch(model, name, **kw), prompts, arrivals, staged=True)
    counters, moving = fresh_compiles(), []
    with torch._dynamo.config.patch(specialize_float=True):
        graph = GraphDecode(torch.compile(static_decode_step, dynamic=True, fullgraph=True,
                                          backend=graph_blockers(moving)), decode_step)
        got, _ = drive(row_batch(model, name, decode=graph, **kw), prompts, arrivals, staged=True)
    for n in prompts:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-5)
    assert not moving and graph.dynamic_steps == 0 and graph.static_steps > 30
    assert counters["stats"]["unique_graphs"] <= 2
