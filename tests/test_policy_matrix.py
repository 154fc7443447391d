"""The policy test matrix: every registered policy x KV storage (16-bit, KIVI 4-bit, KIVI 2-bit where the
policy has packed storage) x batch (1 prompt; 3 prompts of different lengths) keeps what the contract
(cache/contract.py) promises.  A policy joins by being registered (cache.register): the cells are made
from the registry when this module is collected, so a test module that registers a policy and imports
these tests runs them for it too (test_a_registered_policy_joins_the_matrix shows it).

Each cell runs a tiny random Llama (3 layers, GQA 4:2, head_dim 16) at the policy's defaults on prompts
longer than the default budgets, and checks:
  - prefill + decode steps run, with finite logits;
  - kept tokens never exceed the budget (policies with a `budget`), reads never exceed N_c (readers);
  - nothing is allocated after decode step 1 (storage buffers and kv_bytes()["allocated"]; the contract lets
    before_decode_step reallocate, as SimLayerKV's decode strategy does once before step 1);
  - greedy runs are deterministic (bit for bit);
  - under `full_cache_args(n)` the logits equal the full cache's (where the policy makes that promise);
  - bad parameters are clear PolicyErrors naming the parameter;
  - what is kept: a policy whose kept set is the top budget of its own token scores (decided from its class:
    keeps_top_token_scores) keeps, per layer, row and KV head, the top budget of its rule written out naively
    (REFERENCE_RULES) plus its sinks and recent window, after prefill and after each decode step; every other
    policy is named in KEPT_SET_ORACLES with the tests that check its kept set;
  - requests that join and leave rows of a running batch (RowBatch) get the tokens and logits they
    get alone, with nothing allocated after the batch starts.
"""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cache import POLICIES, PolicyError, make_policy, policy_params
from cache.quantized import with_kv_bits
from cache.base import EvictionPolicy
from cache.knorm import KnormPolicy
from cache.scored import ScoredEviction
from model import DenseCache, ModelArgs
from runtime.rows import RowBatch
from runtime.steps import run_decode, run_prefill
from tests.helpers import kept, left_padded, random_llama

ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, intermediate_size=128,
                 max_position_embeddings=2048)
BATCHES = {"b1": [600], "b3": [600, 420, 530]}
STORAGES = {"kv16": 16, "kv4": 4, "kv2": 2}
KIVI_G, KIVI_R = 8, 16
STEPS = 6


def storage_ok(name: str, bits: int) -> bool:
    try:
        with_kv_bits(make_policy(name), bits, KIVI_G, KIVI_R)
        return True
    except (ValueError, PolicyError):
        return False


def pytest_generate_tests(metafunc):
    """The cells, from the registry as it is now (so a policy registered before this runs joins)."""
    names = sorted(POLICIES)
    if "cell" in metafunc.fixturenames:
        cells = [(n, s, b) for n in names for s, bits in STORAGES.items() if bits == 16 or storage_ok(n, bits)
                 for b in BATCHES]
        metafunc.parametrize("cell", cells, ids=[f"{n}-{s}-{b}" for n, s, b in cells])
    elif "admission_cell" in metafunc.fixturenames:     # 16-bit, and 4-bit where the policy has it
        cells = [(n, s) for n in names for s in ("kv16", "kv4") if s == "kv16" or storage_ok(n, STORAGES[s])]
        metafunc.parametrize("admission_cell", cells, ids=[f"{n}-{s}" for n, s in cells])
    elif "variant" in metafunc.fixturenames:     # head aggregations other than the default
        cells = [(n, s, f"head_agg={agg}") for n in names if "head_agg" in policy_params(POLICIES[n])
                 for agg in POLICIES[n].head_aggs if agg != policy_params(POLICIES[n])["head_agg"][1] for s in ("kv16", "kv4")]
        metafunc.parametrize("variant", cells, ids=[f"{n}-{s}-{a}" for n, s, a in cells])
    elif "policy_name" in metafunc.fixturenames:
        metafunc.parametrize("policy_name", names)


@pytest.fixture(scope="module")
def model():
    return random_llama(ARGS)


def build(name: str, storage: str, args: dict | str | None = None):
    return with_kv_bits(make_policy(name, args or {}), STORAGES[storage], KIVI_G, KIVI_R)


def run(model, policy, lengths: list[int], on_step=None) -> torch.Tensor:
    """Prefill + STEPS greedy decode steps -> logits [STEPS + 1, B, V]; on_step(i, policy) after step i."""
    tokens, pos = left_padded(lengths, vocab=ARGS.vocab_size, seed=len(lengths))
    model.setup_caches(len(lengths), max(lengths) + STEPS + 1, policy)     # tiny model: nothing to prepare
    with torch.inference_mode():
        logits = [run_prefill(model, tokens, pos)]
        token, p = logits[0].argmax(-1, keepdim=True), pos[:, -1:] + 1
        for i in range(STEPS):
            logits.append(run_decode(model, token, p + i, i))
            token = logits[-1].argmax(-1, keepdim=True)
            if on_step:
                on_step(i, policy)
    return torch.stack(logits)


def storage_tensors(obj, path="policy", seen=None) -> dict[str, int]:
    """data_ptr of the storage buffers: every tensor in a per-layer list of the policy (or of its inner
    storage), and every tensor attribute of an object held in such a list (a packed slot store).  Dicts
    (per-step scratch: pending prompt K/V, kernel workspaces, shared logits) are not storage."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    out: dict[str, int] = {}
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            if isinstance(value, torch.Tensor):
                out[f"{path}[{i}]"] = value.data_ptr()
            elif value is not None:
                out.update(storage_tensors(value, f"{path}[{i}]", seen))
                out.update({f"{path}[{i}].{k}": v.data_ptr() for k, v in vars(value).items()
                            if isinstance(v, torch.Tensor)} if hasattr(value, "__dict__") else {})
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("cache", "model", "kernels"):
        for key, value in vars(obj).items():
            held = hasattr(value, "__dict__") and key in ("inner", "storage_", "labels", "slots")
            if isinstance(value, (list, tuple)) or held:
                out.update(storage_tensors(value, f"{path}.{key}", seen))
    return out


def kept_prompt_tokens(policy, lengths: list[int]) -> int:
    """Prompt tokens kept, summed over layers, for the (row, KV head) that keeps the most."""
    n = torch.tensor(lengths)[:, None, None]
    per_layer = [((pos >= 0) & (pos < n)).sum(-1)                               # [B, H_kv]
                 for pos in (policy.kept_positions(layer) for layer in range(ARGS.n_layers))]
    return int(sum(per_layer).max())


# --------------------------------------------------------------------------- the cells

def test_cell(model, cell):
    name, storage, batch = cell
    lengths = BATCHES[batch]
    cls = POLICIES[name]
    snapshots = {}

    def watch(i, policy):
        if i <= 1:      # the contract lets before_decode_step reallocate once (SimLayerKV trims before step 1)
            snapshots["buffers"] = storage_tensors(policy)
            snapshots["allocated"] = policy.kv_bytes()["allocated"]
        else:
            now = storage_tensors(policy)
            moved = [k for k, ptr in snapshots["buffers"].items() if now.get(k, ptr) != ptr]
            assert not moved, f"decode step {i} reallocated {moved[:4]}"
            assert policy.kv_bytes()["allocated"] == snapshots["allocated"]
        if policy.is_sparse_reader:
            policy.record_reads = True
            if i > 0:
                for layer in range(ARGS.n_layers):
                    reads = policy.read_positions(layer)
                    assert max(len(h) for row in reads for h in row) <= policy.max_reads()

    policy = build(name, storage)
    first = run(model, policy, lengths, watch)
    assert torch.isfinite(first).all()
    if "budget" in policy_params(cls) and getattr(policy, "budget", 0) > 0:
        assert kept_prompt_tokens(policy, lengths) <= ARGS.n_layers * policy.budget
    again = run(model, build(name, storage), lengths)
    assert torch.equal(first, again), "greedy decoding is not deterministic"


def test_cell_full_cache_promise(model, cell):
    name, storage, batch = cell
    lengths = BATCHES[batch]
    promise = POLICIES[name].full_cache_args(max(lengths) + STEPS + 1)
    if promise is None:
        pytest.skip(f"{name} makes no full-cache promise (full_cache_args is None)")
    kept = {}
    full = run(model, build("full", storage), lengths)
    ours = run(model, build(name, storage, promise), lengths, lambda i, p: kept.update(last=all_positions(p)))
    assert kept["last"] == [sorted(range(n + STEPS)) for n in lengths for _ in range(ARGS.n_kv_heads)], \
        "under full_cache_args some token is missing"
    if storage != "kv16" and len(set(lengths)) > 1:
        return      # packed groups of left-padded rows hold other slots than full's: rounding differs, not tokens
    tol = 1e-5 if storage == "kv16" else 2e-4
    torch.testing.assert_close(ours, full, atol=tol, rtol=tol)


def all_positions(policy) -> list[list[int]]:
    """Per (row, KV head), the sorted positions every layer holds (a reader: its storage's)."""
    store = policy.inner if policy.is_sparse_reader else policy
    rows = []
    for b in range(store.kept_positions(0).shape[0]):
        for h in range(ARGS.n_kv_heads):
            layers = [sorted(p for p in store.kept_positions(layer)[b, min(h, store.kept_positions(layer).shape[1] - 1)]
                             .tolist() if p >= 0) for layer in range(ARGS.n_layers)]
            assert all(x == layers[0] for x in layers), f"layers hold different tokens under full_cache_args"
            rows.append(layers[0])
    return rows


def test_head_aggregation_variant(model, variant):
    """head_agg=max / query under the same guarantees; query keeps a token set per query head."""
    name, storage, args = variant
    lengths = BATCHES["b3"]
    policy = build(name, storage, args)
    first = run(model, policy, lengths)
    assert torch.isfinite(first).all()
    if policy.is_sparse_reader:                  # query: a list per query head; reads within N_c per list
        policy.record_reads = True
        run(model, policy, lengths)
        reads = policy.read_positions(0)
        assert len(reads[0]) == (ARGS.n_heads if args.endswith("query") else ARGS.n_kv_heads)
        assert max(len(h) for row in reads for h in row) <= policy.max_reads()
    else:
        heads = ARGS.n_heads if args.endswith("query") else ARGS.n_kv_heads
        assert policy.kept_positions(0).shape[1] == heads
        assert kept_prompt_tokens(policy, lengths) <= ARGS.n_layers * policy.budget
    assert torch.equal(first, run(model, build(name, storage, args), lengths))
    promise = {**POLICIES[name].full_cache_args(max(lengths) + STEPS + 1), "head_agg": args.split("=")[1]}
    if storage == "kv16":
        torch.testing.assert_close(run(model, build(name, storage, promise), lengths),
                                   run(model, build("full", storage), lengths), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- rows that join and leave

NEW = 8                                               # tokens each request generates
REQUESTS = {"A": (300, 0), "B": (210, 3), "C": (260, NEW + 1)}   # prompt length, arrival (decode step)


def requests() -> tuple[dict, dict, int]:
    """REQUESTS as (prompt ids per request, arrival step per request, the max_seq_length that holds them)."""
    g = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(0, ARGS.vocab_size, (length,), generator=g).tolist()
               for n, (length, _) in REQUESTS.items()}
    arrivals = {n: arrival for n, (_, arrival) in REQUESTS.items()}
    return prompts, arrivals, max(length for length, _ in REQUESTS.values()) + NEW


def alone(model, policy, ids: list[int], max_seq: int) -> torch.Tensor:
    """Logits [NEW, V] of greedy decoding `ids` alone in a batch of one (run_prefill / run_decode)."""
    model.setup_caches(1, max_seq, policy)
    with torch.inference_mode():
        logits = [run_prefill(model, torch.tensor([ids]), torch.arange(len(ids))[None])[0]]
        for i in range(NEW - 1):
            token = logits[-1].argmax().view(1, 1)
            logits.append(run_decode(model, token, torch.tensor([[len(ids) + i]]), i)[0])
    return torch.stack(logits)


def serve(batch: "RowBatch", prompts: dict, arrivals: dict, on_step=None) -> tuple[dict, list]:
    """Run `prompts` through `batch`, each arriving at its decode step in `arrivals` (first come, first
    served; each leaves after NEW tokens) -> (logits [NEW, V] per request, {request: row} after each
    step's admissions)."""
    got: dict = {n: [] for n in prompts}
    rows, waiting, timeline = {}, [], []
    with torch.inference_mode():
        for t in range(4 * NEW + 8):                  # bounded: every request is done well before
            waiting += [n for n in prompts if arrivals[n] == t]
            for row, logits in batch.admit([prompts[n] for n in waiting]):
                rows[waiting[0]] = row
                got[waiting.pop(0)].append(logits)
            timeline.append(dict(rows))
            if not rows and not waiting and t > max(arrivals.values()):
                break
            if rows:
                logits = batch.step({r: int(got[n][-1].argmax()) for n, r in rows.items()})
                if on_step:
                    on_step(batch.policy)
                for n, r in list(rows.items()):
                    got[n].append(logits[r])
                    if len(got[n]) == NEW:
                        batch.release(r)
                        del rows[n]
    return {n: torch.stack(v) for n, v in got.items()}, timeline


def test_prompts_prefilled_together_equal_each_alone(model, admission_cell):
    """RowBatch(prefill_batch=3): three prompts of different lengths admitted together go through the model as one
    left-padded group (chunks of 32 columns: the short prompts' first chunks are padding alone) and join the batch
    together; each request's greedy tokens and logits equal those it gets prefilled alone (prefill_batch=1), for
    every policy that admits rows (a batch-admission policy prefills its group as one batch anyway).  KIVI storage
    prefills its prompts one at a time (its quantization groups are runs of slots, which padding would move)."""
    name, storage = admission_cell
    g = torch.Generator().manual_seed(2)
    prompts = {n: torch.randint(0, ARGS.vocab_size, (k,), generator=g).tolist() for n, k in (("A", 150), ("B", 61),
                                                                                            ("C", 97))}
    make = lambda: build(name, storage)        # noqa: E731
    batch = RowBatch(model, make, 3, 150 + NEW, NEW, prefill_chunk=32, prefill_batch=3)
    if not batch.rows:
        pytest.skip(f"{name} admits whole batches")
    rows_per_forward, prefill = [], batch.prefill
    batch.prefill = lambda m, tokens, *a: rows_per_forward.append(tokens.shape[0]) or prefill(m, tokens, *a)
    got, timeline = serve(batch, prompts, dict.fromkeys(prompts, 0))
    ref, _ = serve(RowBatch(model, make, 3, 150 + NEW, NEW, prefill_chunk=32), prompts, dict.fromkeys(prompts, 0))
    assert rows_per_forward and set(rows_per_forward) == {3 if storage == "kv16" else 1}, rows_per_forward
    assert timeline[0] == {"A": 0, "B": 1, "C": 2}, timeline[0]
    for n in prompts:
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), f"request {n}'s tokens differ prefilled together"
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


def test_requests_join_and_leave_rows(model, admission_cell):
    """B joins row 1 while A decodes in row 0; C takes A's row once A is done.  Each request's greedy tokens
    and logits equal its run alone in a batch of the same size (16-bit storage: also alone in a batch of
    one); nothing is reallocated once the batch runs; a batch-admission policy starts each request in an
    empty batch.  (Against a batch of one, 4-bit storage can differ beyond 1e-5: the linear layers' GEMM
    rounds a row differently at another batch size, and a one-ulp change can flip a KIVI code.)"""
    name, storage = admission_cell
    prompts, arrivals, max_seq = requests()
    make = lambda: build(name, storage)        # noqa: E731
    buffers: dict = {}

    def no_reallocation(policy):
        now = storage_tensors(policy)
        buffers.setdefault("first", now)
        moved = [k for k, ptr in buffers["first"].items() if now.get(k, ptr) != ptr]
        assert not moved, f"a decode step reallocated {moved[:4]}"

    batch = RowBatch(model, make, 2, max_seq, NEW)
    got, timeline = serve(batch, prompts, arrivals, no_reallocation if batch.rows else None)
    for n, ids in prompts.items():
        ref, _ = serve(RowBatch(model, make, 2, max_seq, NEW), {n: ids}, {n: 0})
        assert torch.equal(got[n].argmax(-1), ref[n].argmax(-1)), f"request {n}'s tokens differ from its run alone"
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)
        if storage == "kv16":
            torch.testing.assert_close(got[n], alone(model, make(), ids, max_seq), atol=1e-5, rtol=1e-5)
    together = [rows for rows in timeline if len(rows) == 2]
    if batch.rows:
        assert {"A": 0, "B": 1} in together and {"C": 0} in timeline, timeline
    else:
        assert not together, f"{name} admits whole batches, yet requests overlapped: {timeline}"


@pytest.mark.parametrize("spec, args", [("snapkv+quest", "budget=128,n_sink=4,n_recent=8"),
                                        ("snapkv+ds", "budget=128,n_critical=32,n_sink=4,n_recent=8,heavy_channels=4")])
def test_readers_over_packed_eviction_storage_join_rows(model, spec, args):
    """A sparse reader over 4-bit eviction storage: the first request to join a RowBatch makes the reader
    build its index from the packed slots before the batch's first forward, with `now` as adopt recorded
    it (EvictionPolicy.kv_store read q_pos there, still None: quest's build raised).  Each request's
    logits equal its run alone in a batch of the same size."""
    prompts, arrivals, max_seq = requests()
    make = lambda: build(spec, "kv4", args)        # noqa: E731
    got, _ = serve(RowBatch(model, make, 2, max_seq, NEW), prompts, arrivals)
    for n, ids in prompts.items():
        ref, _ = serve(RowBatch(model, make, 2, max_seq, NEW), {n: ids}, {n: 0})
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- parameters

def test_bad_parameters_are_clear_errors(policy_name):
    cls = POLICIES[policy_name]
    with pytest.raises(PolicyError, match="no parameter"):
        make_policy(policy_name, {"no_such_parameter": "1"})
    for key, (kind, default, help_text) in policy_params(cls).items():
        assert help_text, f"{policy_name}.{key} has no help text"
        if kind in (int, float, bool):
            with pytest.raises(PolicyError, match=key):
                make_policy(policy_name, {key: "not-a-number"})
    for old, new in cls.renamed.items():
        with pytest.raises(PolicyError, match=f"'{old}' is now '{new}'"):
            make_policy(policy_name, {old: "1"})


ONE_METHOD = sorted(n for n, cls in POLICIES.items() if issubclass(cls, ScoredEviction))


@pytest.mark.parametrize("name", ONE_METHOD)
def test_one_method_tier_refuses_negative_windows(name):
    """Every policy on the one-method tier (cache/scored.py) refuses a negative n_sink or n_recent by name, also
    where the policy wrote no validate of its own (a copy of the guide's old knorm accepted n_recent=-5)."""
    for key in ("n_sink", "n_recent"):
        if key in policy_params(POLICIES[name]):
            with pytest.raises(PolicyError, match=f"{name}.*{key} must be a non-negative integer, got -5"):
                make_policy(name, {key: "-5"})


def test_every_policy_follows_the_contract(policy_name):
    from cache.contract import CachePolicy
    assert isinstance(make_policy(policy_name), CachePolicy)


# --------------------------------------------------------------------------- what is kept

RULE_HOOKS = ("keep_scores", "decode_victim", "observe", "prefill_stats", "plan", "on_compress", "on_evict",
              "layer_budget", "layer_budgets", "compress", "store", "decode", "lowest", "protected")


def keeps_top_token_scores(cls: type) -> bool:
    """The class's kept set is the top budget of its own `token_scores` plus the sinks and the recent window: an
    eviction policy that evicts in decode and overrides none of the hooks that make another rule."""
    return (isinstance(cls, type) and issubclass(cls, EvictionPolicy) and not cls.is_sparse_reader
            and not cls.decode_attention and not cls.appending and not cls.defer_compression
            and all(getattr(cls, hook) is getattr(EvictionPolicy, hook) for hook in RULE_HOOKS))


SCORED = sorted(n for n, cls in POLICIES.items() if keeps_top_token_scores(cls))

# Each scored policy's rule written out naively: (keep score of a token from its key k [D], value v [D] and
# position p, the recent window of a row whose budget is `budget`, from the policy's parameters).
REFERENCE_RULES = {
    "knorm": (lambda k, v, p: -math.sqrt(sum(x * x for x in k.tolist())), lambda budget, policy: policy.n_recent),
    "streaming": (lambda k, v, p: float(p), lambda budget, policy: budget - policy.n_sink),
}

# The policies with other rules, and the tests that check what they keep (or read) against an oracle.
KEPT_SET_ORACLES = {
    "full": ["tests/test_policy_matrix.py::test_cell_full_cache_promise"],
    "snapkv": [
        "tests/test_policies.py::test_snapkv_avg_pooling_keeps_topk_of_pooled_group_mean_window_scores_plus_window",
        "tests/test_policies.py::test_snapkv_max_pooling_differs_from_no_pooling_and_window_always_kept"],
    "pyramidkv": ["tests/test_policies.py::test_pyramid_budgets_sum_exactly_and_follow_the_schedule",
                  "tests/test_policies.py::test_pyramidkv_at_budget_900_keeps_what_a_1000_token_prompt_allows"],
    "h2o": ["tests/test_policies.py::test_h2o_prefill_keeps_sinks_recent_and_heaviest_column_sums",
            "tests/test_policies.py::test_h2o_decode_accumulates_attention_and_evicts_the_lowest"],
    "tova": ["tests/test_policies.py::test_tova_prefill_keeps_what_the_last_query_attends_to_most",
             "tests/test_policies.py::test_tova_decode_evicts_the_slot_the_new_query_attends_to_least"],
    "d2o": ["tests/test_policies.py::test_d2o_prefill_merges_evicted_tokens_with_weighted_average",
            "tests/test_policies.py::test_d2o_decode_merge_and_ema_follow_the_formulas",
            "tests/test_policies.py::test_d2o_layer_budgets_split_by_variance_and_sum_to_total"],
    "simlayerkv": ["tests/test_policies.py::test_simlayerkv_lazy_layers_keep_initial_and_recent_ring",
                   "tests/test_policies.py::test_simlayerkv_flags_layers_whose_mass_exceeds_delta"],
    "pod": ["tests/test_pod.py::test_snapkv_selection_is_made_by_the_first_layer_and_shared_by_its_block",
            "tests/test_pod.py::test_every_layer_its_own_block_equals_full_cache"],
    "ds": ["tests/test_hshare.py::test_ds_selects_sinks_recent_and_top_middle_by_heavy_channel_scores"],
    "quest": ["tests/test_hshare.py::test_quest_reads_sinks_recent_and_the_pages_of_highest_upper_bound"],
    "hshare": ["tests/test_hshare.py::test_hshare_critical_sets_rank_as_decode_does",
               "tests/test_hshare.py::test_greedy_sharing_follows_algorithm_1_on_a_hand_made_matrix"],
}

KEPT_ARGS = ModelArgs(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=8, head_dim=8)
KEPT_LENGTHS, KEPT_STEPS, KEPT_BUDGET = [24, 17], 5, 10


def expected_kept(kv: dict, n_seen: int, budget: int, n_sink: int, window: int, score) -> list[int]:
    """The oracle: of the tokens seen (position -> (key, value) [D]), the first n_sink and the last `window` always,
    then the best `score` (ties: the earlier position) up to `budget`, sorted."""
    always = {p for p in kv if p < n_sink or p >= n_seen - window}
    rest = sorted((p for p in kv if p not in always), key=lambda p: (-score(*kv[p], p), p))
    return sorted(always | set(rest[:max(0, budget - len(always))]))


def check_kept_set(cls: type, rule, args: dict) -> None:
    """Random K/V through a bare `cls(**args)` (2 layers, rows of KEPT_LENGTHS left-padded, 2 KV heads): after
    prefill and after each of KEPT_STEPS decode steps, what each layer, row and KV head holds equals expected_kept
    of every token it was fed (in decode the window holds the new token at least: a slot cache always stores it)."""
    score, window = rule
    policy = cls(**args)
    B, T, L, H = len(KEPT_LENGTHS), max(KEPT_LENGTHS), KEPT_ARGS.n_layers, KEPT_ARGS.n_kv_heads
    policy.setup(KEPT_ARGS, B, T + KEPT_STEPS, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    seen = {(layer, b, h): {} for layer in range(L) for b in range(B) for h in range(H)}   # position -> (k, v)
    prompt_pos = torch.stack([torch.arange(T) - (T - n) for n in KEPT_LENGTHS]).clamp(min=-1)
    for step in range(-1, KEPT_STEPS):              # -1: the prompt
        input_pos = prompt_pos if step < 0 else torch.tensor(KEPT_LENGTHS)[:, None] + step
        if step >= 0:
            policy.before_decode_step(step)
        policy.begin(input_pos)
        for layer in range(L):
            n = input_pos.shape[1]
            q = torch.randn(B, KEPT_ARGS.n_heads, n, 8, generator=g)
            k, v = torch.randn(B, H, n, 8, generator=g), torch.randn(B, H, n, 8, generator=g)
            for b in range(B):
                for t, p in enumerate(input_pos[b].tolist()):
                    for h in range(H):
                        if p >= 0:
                            seen[(layer, b, h)][p] = k[b, h, t], v[b, h, t]
            (policy.prefill if step < 0 else policy.decode)(layer, q, k, v)
        if step < 0:
            policy.end_prefill()
        for layer in range(L):
            held = kept(policy, layer)
            w = window(args["budget"], policy) if step < 0 else max(window(args["budget"], policy), 1)
            when = "prefill" if step < 0 else f"decode step {step}"
            for b, n in enumerate(KEPT_LENGTHS):
                for h in range(H):
                    want = expected_kept(seen[(layer, b, h)], n + step + 1, args["budget"], policy.n_sink, w, score)
                    assert held[b][h] == want, (f"{cls.__name__} after {when}, layer {layer}, row {b}, KV head {h}: "
                                                f"kept {held[b][h]}, the rule keeps {want}")


def kept_set_args(cls: type, windows: bool) -> dict:
    """With windows: n_sink=2 and n_recent=3 where the policy has them (else its defaults); budget=KEPT_BUDGET, or
    2 more than the sinks and window take when they take more (a policy's default windows may be wide)."""
    declared = policy_params(cls)
    args = {k: v for k, v in (("n_sink", 2), ("n_recent", 3)) if k in declared} if windows else {}
    fixed = sum(args.get(k, declared[k][1]) for k in ("n_sink", "n_recent") if k in declared)
    return {"budget": max(KEPT_BUDGET, fixed + 2), **args}


@pytest.mark.parametrize("windows", [True, False], ids=["windows", "defaults"])
@pytest.mark.parametrize("name", SCORED)
def test_kept_set_is_the_top_budget(name, windows):
    assert name in REFERENCE_RULES, f"{name} keeps the top of its token_scores: write its rule in REFERENCE_RULES"
    cls = POLICIES[name]
    check_kept_set(cls, REFERENCE_RULES[name], kept_set_args(cls, windows))


class NegatedKnorm(KnormPolicy):
    """knorm with its score negated: keeps the keys of highest norm, the tokens knorm evicts."""
    name = "knorm-negated-test"

    def token_scores(self, layer, k, v, pos):
        return -super().token_scores(layer, k, v, pos)


@pytest.mark.parametrize("windows", [True, False], ids=["windows", "defaults"])
def test_the_kept_set_cell_fails_a_negated_score(windows):
    """A test of the test: the negated knorm passes every other cell of the matrix, but not this one."""
    assert keeps_top_token_scores(NegatedKnorm)
    with pytest.raises(AssertionError, match="the rule keeps"):
        check_kept_set(NegatedKnorm, REFERENCE_RULES["knorm"], kept_set_args(NegatedKnorm, windows))


def test_every_kept_set_has_an_oracle():
    """Every registered policy is checked by the kept-set cell (its rule is a token score) or named in
    KEPT_SET_ORACLES with tests that exist, so a new policy cannot join without an oracle for what it keeps."""
    root = Path(__file__).resolve().parent.parent
    for name in sorted(POLICIES):
        problem = ("checked by the kept-set cell, yet named in KEPT_SET_ORACLES" if name in SCORED else
                   "no oracle for what it keeps: name its tests in KEPT_SET_ORACLES")
        assert (name in SCORED) != (name in KEPT_SET_ORACLES), f"{name}: {problem}"
    assert set(KEPT_SET_ORACLES) <= set(POLICIES), sorted(set(KEPT_SET_ORACLES) - set(POLICIES))
    for name, tests in KEPT_SET_ORACLES.items():
        for test in tests:
            path, _, function = test.partition("::")
            assert f"def {function}(" in (root / path).read_text(), f"{name}: {test} does not exist"
    assert {"knorm", "streaming"} <= set(SCORED) & set(ONE_METHOD)


# --------------------------------------------------------------------------- joining the matrix

TRIVIAL = '''
from dataclasses import dataclass

import torch
from cache import register
from cache.base import EvictionPolicy
from cache.params import Budget
from cache.scoring import NEVER


@register
@dataclass(eq=False)
class KeepFirst(Budget, EvictionPolicy):
    """Keeps the first `budget` prompt tokens, evicts the oldest non-first token in decode."""
    name = "keep-first-test"

    def keep_scores(self, layer, stats, q_pos, n_heads):
        return (-q_pos.float()).masked_fill(q_pos < 0, NEVER)[:, None, :].expand(-1, n_heads, -1)

    def decode_victim(self, layer):
        pos = self.pos[layer]
        return self.lowest(layer, pos.float(), pos < 1)


from tests.test_policy_matrix import *  # noqa: E402,F401,F403  the matrix, now with keep-first-test
'''


@pytest.mark.slow
def test_a_registered_policy_joins_the_matrix(tmp_path):
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    module = root / "tests" / "test_matrix_join_tmp.py"
    module.write_text(textwrap.dedent(TRIVIAL))
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module),
                              "-k", "keep-first-test"], cwd=root, capture_output=True, text=True, timeout=600)
    finally:
        module.unlink()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    tests = 2 * len(BATCHES) * len(STORAGES) + 2 + 2 + 2  # cell + promise per storage and batch; parameters;
                                                          # contract; joining rows, prefilled together at 16, 4 bits
    assert f"{tests} passed" in out.stdout, out.stdout[-2000:]
