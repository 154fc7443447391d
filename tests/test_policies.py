"""The eviction family (H2O, SnapKV, PyramidKV, D2O, SimLayerKV) against hand-computed references:
kept sets from the papers' formulas written out naively here, budget schedules, decode-time
eviction invariants, D2O's merge and EMA formulas, SimLayerKV's lazy flags, equivalence with the
full cache when nothing is evicted, and the real-model claims (first token, kv_bytes)."""
import math

import pytest
import torch

import checkpoint
import engine
from cache import POLICIES, PolicyError, make_policy, policy_params
from cache.base import EvictionPolicy
from cache.scoring import column_scores, fill_to_cap, pool1d, pyramid_budgets, split_integer
from cache.simlayerkv import DELTA_BY_FAMILY, model_family
from model import ModelArgs
from runtime.steps import decode_step, run_decode, run_prefill
from tests.helpers import kept, left_padded, tiny_hf_model

EVICTION = [name for name, cls in POLICIES.items() if issubclass(cls, EvictionPolicy)]   # the registry's


def small_args(name: str, n: int) -> dict:
    """Arguments that keep about n prompt tokens per layer and head: a budget of n, or, for a policy without
    one, its full-cache arguments for n tokens (SimLayerKV: what its lazy layers keep)."""
    cls = POLICIES[name]
    return {"budget": n} if "budget" in policy_params(cls) else cls.full_cache_args(n)


def bare_policy(name, args_text, n_heads=4, n_kv_heads=2, head_dim=8, T=20, max_seq=64, layers=1, batch=1):
    """A policy set up for `layers` layers of a made-up model, its prompt positions begun."""
    args = ModelArgs(vocab_size=16, dim=n_heads * head_dim, n_layers=layers, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, intermediate_size=8, head_dim=head_dim)
    policy = make_policy(name, args_text)
    policy.setup(args, batch, max_seq, torch.float32, "cpu")
    policy.begin(torch.arange(T)[None].repeat(batch, 1))
    return policy


def naive_probs(q, k):
    """Causal softmax per query head: q [Hq, T, D], k [Hkv, T, D] -> [Hq, T, T] (loops, no tricks)."""
    Hq, T, D = q.shape
    G = Hq // k.shape[0]
    out = torch.zeros(Hq, T, T)
    for h in range(Hq):
        for i in range(T):
            logits = torch.tensor([float(q[h, i] @ k[h // G, j]) / math.sqrt(D) for j in range(i + 1)])
            out[h, i, :i + 1] = logits.softmax(0)
    return out


def test_snapkv_avg_pooling_keeps_topk_of_pooled_group_mean_window_scores_plus_window():
    torch.manual_seed(0)
    T, w, budget, kernel = 20, 4, 10, 3
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    policy = bare_policy("snapkv", f"budget={budget},obs_window={w},kernel={kernel},pooling=avg", T=T)
    policy.prefill(0, q, k, v)
    probs = naive_probs(q[0], k[0])
    for h in range(2):
        window_sum = probs[2 * h:2 * h + 2, T - w:].sum(1).mean(0)            # [T]: group mean
        past = window_sum[:T - w]
        pooled = [float(past[max(0, j - 1):j + 2].mean()) for j in range(T - w)]   # avg, no pad counted
        top = sorted(sorted(range(T - w), key=lambda j: -pooled[j])[:budget - w])
        assert kept(policy)[0][h] == top + list(range(T - w, T))


@pytest.mark.parametrize("agg", ["max", "query"])
def test_snapkv_head_aggregation_max_and_per_query_head(agg):
    """max: per window query, the group's largest attention, summed over the window; query: each of the
    4 query heads keeps its own top tokens (4 storage heads, K/V copied from its KV head)."""
    torch.manual_seed(5)
    T, w, budget = 20, 4, 9
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    policy = bare_policy("snapkv", f"budget={budget},obs_window={w},kernel=1,head_agg={agg}", T=T)
    policy.prefill(0, q, k, v)
    probs = naive_probs(q[0], k[0])                                               # [4, T, T]
    heads = range(4) if agg == "query" else range(2)
    assert len(kept(policy)[0]) == len(heads)
    for h in heads:
        rows = probs[h:h + 1] if agg == "query" else probs[2 * h:2 * h + 2]
        score = rows[:, T - w:].amax(0).sum(0) if agg == "max" else rows[0, T - w:].sum(0)
        top = sorted(sorted(range(T - w), key=lambda j: -float(score[j]))[:budget - w])
        assert kept(policy)[0][h] == top + list(range(T - w, T))
        if agg == "query":                                                        # its KV head's keys
            torch.testing.assert_close(policy.k[0][0, h, :budget], k[0, h // 2, top + list(range(T - w, T))])


def test_snapkv_prompt_no_longer_than_the_window_keeps_it_whole():
    for T in (4, 3):
        q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
        policy = bare_policy("snapkv", "budget=8,obs_window=4", T=T)
        policy.prefill(0, q, k, v)
        assert kept(policy)[0] == [list(range(T))] * 2


def test_snapkv_max_pooling_differs_from_no_pooling_and_window_always_kept():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    sets = []
    for kernel in (1, 7):
        policy = bare_policy("snapkv", f"budget=12,obs_window=4,kernel={kernel}", T=40)
        policy.prefill(0, q, k, v)
        sets.append(kept(policy)[0])
        assert all(h[-4:] == [36, 37, 38, 39] and len(h) == 12 for h in sets[-1])
    assert sets[0] != sets[1]


def test_h2o_prefill_keeps_sinks_recent_and_heaviest_column_sums():
    torch.manual_seed(2)
    T = 24
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    policy = bare_policy("h2o", "budget=10,n_sink=2,n_recent=4", T=T)
    policy.prefill(0, q, k, v)
    probs = naive_probs(q[0], k[0])
    for h in range(2):
        acc = probs[2 * h:2 * h + 2].sum(1).mean(0)                            # column sums, group mean
        heavy = sorted(range(2, T - 4), key=lambda j: -float(acc[j]))[:4]
        expect = sorted([0, 1] + heavy + list(range(T - 4, T)))
        assert kept(policy)[0][h] == expect
        slots = policy.pos[0][0, h].tolist()
        torch.testing.assert_close(policy.score[0][0, h], acc[slots])          # scores travel with slots


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool1d_within_a_prefix_equals_pooling_the_prefix_alone(kind):
    """SnapKV pools only the tokens before its window: the masked pool equals torch's pool of
    the sliced prefix (padding kernel // 2, avg over in-range columns only)."""
    torch.manual_seed(0)
    scores, T, prefix = torch.rand(2, 3, 20), 20, 13
    torch_pool = torch.nn.functional.max_pool1d if kind == "max" else (
        lambda x, k, stride, padding: torch.nn.functional.avg_pool1d(x, k, stride, padding, count_include_pad=False))
    expected = torch_pool(scores[..., :prefix].reshape(6, 1, prefix), 7, stride=1, padding=3).reshape(2, 3, prefix)
    within = torch.arange(T) < prefix
    torch.testing.assert_close(pool1d(scores, 7, kind, within)[..., :prefix], expected)
    full = torch_pool(scores.reshape(6, 1, T), 5, stride=1, padding=2).reshape(2, 3, T)
    torch.testing.assert_close(pool1d(scores, 5, kind), full)


def test_column_scores_chunking_and_last_rows_padding_change_nothing():
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 11, 8), torch.randn(2, 3, 11, 8)
    pos = torch.arange(11).repeat(2, 1)
    pos[1, :3] = -1                                                       # a left-padded row
    probs = torch.softmax((q.view(2, 3, 2 * 11, 8) @ k.transpose(-1, -2)).view(2, 3, 2, 11, 11) / 8 ** 0.5
                          + torch.where(pos[:, None, None, None, :] <= pos[:, None, None, :, None], 0, -math.inf)
                          + torch.where(pos[:, None, None, None, :] < 0, -math.inf, 0), -1)
    probs = probs.nan_to_num() * (pos >= 0)[:, None, None, :, None]
    for chunks in (1, 4, 16):
        torch.testing.assert_close(column_scores(q, k, pos, None, chunks=chunks), probs.sum(3).mean(2))
    torch.testing.assert_close(column_scores(q, k, pos, 4), probs[:, :, :, -4:].sum(3).mean(2))
    torch.testing.assert_close(column_scores(q, k, pos, 30), probs.sum(3).mean(2))   # rows > T


def test_pyramid_budgets_sum_exactly_and_follow_the_schedule():
    for layers, budget, window, beta in [(30, 256, 8, 20), (32, 128, 8, 20), (7, 64, 8, 5), (2, 9, 8, 20)]:
        b = pyramid_budgets(layers, budget, window, beta)
        assert sum(b) == layers * budget
        assert all(x >= window for x in b) and b == sorted(b, reverse=True)
        rem = layers * (budget - window)
        assert abs(b[-1] - window - rem / (beta * layers)) < 1
        assert abs(b[0] - window - (2 * rem / layers - rem / (beta * layers))) < 1
    assert split_integer(10, [1, 1, 1]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])


def test_tova_prefill_keeps_what_the_last_query_attends_to_most():
    torch.manual_seed(3)
    T, budget = 20, 8
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    policy = bare_policy("tova", f"budget={budget}", T=T)
    policy.prefill(0, q, k, v)
    layer_mean = naive_probs(q[0], k[0])[:, T - 1].mean(0)      # last query, mean over all 4 query heads
    top = sorted(sorted(range(T), key=lambda j: -float(layer_mean[j]))[:budget])
    assert kept(policy)[0] == [top, top]                         # the same tokens in every KV head


def test_tova_decode_evicts_the_slot_the_new_query_attends_to_least():
    torch.manual_seed(4)
    T, budget, D = 20, 8, 8
    q, k, v = torch.randn(1, 4, T, D), torch.randn(1, 2, T, D), torch.randn(1, 2, T, D)
    policy = bare_policy("tova", f"budget={budget}", T=T)
    policy.prefill(0, q, k, v)
    policy.end_prefill()
    kc, pos = policy.k[0].clone(), policy.pos[0].clone()         # [1, 2, 8, D], [1, 2, 8]
    q1, k1, v1 = torch.randn(1, 4, 1, D), torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D)
    policy.begin(torch.tensor([[T]]))
    policy.decode(0, q1, k1, v1)
    probs = []                                                   # per query head: softmax over 8 slots + new
    for h in range(4):
        logits = torch.cat([kc[0, h // 2] @ q1[0, h, 0], k1[0, h // 2] @ q1[0, h, 0]]) / math.sqrt(D)
        probs.append(logits.softmax(0)[:-1])
    victim = int(torch.stack(probs).mean(0).argmin())            # one slot index for the whole layer
    for h in range(2):
        assert int(policy.pos[0][0, h, victim]) == T
        assert [int(p) for s, p in enumerate(pos[0, h]) if s != victim] == \
               [int(p) for s, p in enumerate(policy.pos[0][0, h]) if s != victim]


def test_fill_to_cap_redistributes_the_surplus_of_full_layers():
    assert fill_to_cap([10, 6, 2], 5) == [5, 5, 5]                 # 18 wanted, 15 possible: all full
    out = fill_to_cap([12, 6, 2, 0], 8)                            # 20 wanted, room 32: 4 surplus from layer 0
    assert out[0] == 8 and sum(out) == 20 and all(x <= 8 for x in out)
    assert out[1] - 6 >= out[2] - 2 >= out[3]                       # shared in proportion to the schedule
    assert fill_to_cap([3, 2, 1], 9) == [3, 2, 1]                   # nothing capped: unchanged
    for layers, budget, T in [(30, 900, 1000), (30, 256, 300), (32, 2048, 2100), (7, 64, 65)]:
        b = fill_to_cap(pyramid_budgets(layers, budget, 8, 20), T)
        assert sum(b) == min(layers * budget, layers * T) and max(b) <= T


def test_pyramidkv_at_budget_900_keeps_what_a_1000_token_prompt_allows():
    """Issue 20: the top layers' budgets exceed the prompt; their surplus goes to the others (>= 99%)."""
    policy = bare_policy("pyramidkv", "budget=900", T=1000, max_seq=1010, layers=30)
    assert sum(policy.budgets) >= 0.99 * 30 * 900 and max(policy.budgets) <= 1000
    assert sum(min(b, 1000) for b in pyramid_budgets(30, 900, 8, 20)) < 0.9 * 30 * 900    # what dropping the surplus kept


def test_pyramidkv_layers_allocate_their_own_capacity(tmp_path):
    _, model = tiny_hf_model("llama31", tmp_path)
    policy = make_policy("pyramidkv", "budget=16,obs_window=4,pyramid_beta=4")
    tokens, pos = left_padded([40, 40])
    with torch.no_grad():
        model.setup_caches(2, 48, policy)
        run_prefill(model, tokens, pos)
    assert policy.budgets == pyramid_budgets(2, 16, 4, 4) and sum(policy.budgets) == 32
    for layer, b in enumerate(policy.budgets):
        assert policy.k[layer].shape[2] == b + 8                                  # + room for 8 new tokens
        assert all(len(h) == b for row in kept(policy, layer) for h in row)


@pytest.mark.parametrize("name,args", [("h2o", "budget=12,n_sink=2,n_recent=4"),
                                       ("d2o", "budget=14,n_sink=2,recent_share=0.34,gate=1e9"),
                                       ("streaming", "budget=8,n_sink=2")])
def test_decode_eviction_keeps_size_and_never_evicts_sinks_or_recent(name, args, tmp_path):
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    policy = make_policy(name, args)
    tokens, pos = left_padded([30, 9])
    with torch.no_grad():
        model.setup_caches(2, 80, policy)
        run_prefill(model, tokens, pos)
        allocated = policy.kv_bytes()["allocated"]
        last = pos[:, -1:]
        window = int(policy.row_window[0, 0])         # layer 0's recent window (the rows agree here)
        for step in range(1, 31):
            run_decode(model, torch.randint(0, 128, (2, 1)), last + step, step - 1)
            assert policy.kv_bytes()["allocated"] == allocated
            for layer in range(model.args.n_layers):
                cap = policy.k[layer].shape[2]
                for b, row in enumerate(kept(policy, layer)):
                    now = int(last[b]) + step
                    for h in row:
                        assert len(h) == min(cap, now + 1)
                        assert set(range(min(2, now + 1))) <= set(h)                 # sinks
                        assert set(range(max(0, now - window + 1), now + 1)) <= set(h)  # recent


def test_h2o_decode_accumulates_attention_and_evicts_the_lowest(tmp_path):
    _, model = tiny_hf_model("llama31", tmp_path)
    policy = make_policy("h2o", "budget=10,n_sink=2,n_recent=3")
    tokens, pos = left_padded([25])
    seen = {}
    real_decode = policy.decode

    def spy(layer, q, k, v):
        seen[layer] = (q.clone(), k.clone(), policy.k[layer].clone(), policy.pos[layer].clone(),
                       policy.score[layer].clone())
        return real_decode(layer, q, k, v)

    policy.decode = spy
    with torch.no_grad():
        model.setup_caches(1, 40, policy)
        run_prefill(model, tokens, pos)
        run_decode(model, torch.tensor([[5]]), torch.tensor([[25]]), 0)
    q, k_new, kc, pc, score = seen[0]
    D = q.shape[-1]
    for h in range(2):
        logits = torch.cat([q[0, 2 * h:2 * h + 2, 0] @ kc[0, h].T, q[0, 2 * h:2 * h + 2, 0] @ k_new[0, h].T], -1)
        p = (logits / math.sqrt(D)).softmax(-1).mean(0)                        # C + 1 probabilities
        acc = score[0, h] + p[:-1]
        unprotected = [s for s in range(10) if pc[0, h, s] >= 2 and pc[0, h, s] <= 25 - 3]
        victim = min(unprotected, key=lambda s: float(acc[s]))
        assert int(policy.pos[0][0, h, victim]) == 25
        others = [s for s in range(10) if s != victim]
        torch.testing.assert_close(policy.score[0][0, h, others], acc[others])
        torch.testing.assert_close(policy.score[0][0, h, victim], p[-1])


def test_d2o_decode_merge_and_ema_follow_the_formulas():
    policy = bare_policy("d2o", "budget=6,n_sink=1,ema_beta=0.5", n_heads=1, n_kv_heads=1, head_dim=2, T=6)
    kc = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.2], [-1.0, 0.0], [0.5, 0.5]])
    vc = torch.arange(12.0).view(6, 2)
    policy.k[0] = kc.clone()[None, None]
    policy.v[0] = vc.clone()[None, None]
    policy.pos[0] = torch.arange(6)[None, None]
    policy.tau[0] = torch.tensor([[0.9]])
    slot = torch.tensor([[3]])                      # evict (1, 0.2): nearest other is (1, 0), cos 0.9806
    policy.on_evict(0, slot)
    cos = 1 / math.sqrt(1.04)
    assert float(policy.tau[0]) == pytest.approx(0.5 * cos + 0.5 * 0.9)
    w = math.exp(cos)
    expect_k = (math.e * kc[0] + w * kc[3]) / (math.e + w)
    expect_v = (math.e * vc[0] + w * vc[3]) / (math.e + w)
    torch.testing.assert_close(policy.k[0][0, 0, 0], expect_k)
    torch.testing.assert_close(policy.v[0][0, 0, 0], expect_v)
    torch.testing.assert_close(policy.k[0][0, 0, 1:], kc[1:])                   # nothing else touched
    # below the threshold: discarded, threshold still moves
    policy.tau[0] = torch.tensor([[0.99]])
    before = policy.k[0].clone()
    policy.on_evict(0, torch.tensor([[4]]))         # (-1, 0): best cos is 0 ((0,1)); no merge
    torch.testing.assert_close(policy.k[0], before)
    assert float(policy.tau[0]) == pytest.approx(0.5 * max(0.0, -1 / math.sqrt(2), -1 / math.sqrt(1.04)) + 0.5 * 0.99, abs=1e-6)


def test_d2o_prefill_merges_evicted_tokens_with_weighted_average():
    torch.manual_seed(3)
    T = 16
    q, k, v = torch.randn(1, 2, T, 4), torch.randn(1, 1, T, 4), torch.randn(1, 1, T, 4)
    policy = bare_policy("d2o", "budget=6,n_sink=1,recent_share=0.2", n_heads=2, n_kv_heads=1, head_dim=4, T=T)
    policy.prefill(0, q, k, v)
    policy.end_prefill()
    slots = policy.pos[0][0, 0].tolist()
    kn = torch.nn.functional.normalize(k[0, 0], dim=-1)
    sim = kn @ kn[slots].T                                              # [T, kept]
    evicted = [i for i in range(T) if i not in slots]
    best, target = sim[evicted].max(-1)
    tau = float(best.mean())
    assert float(policy.tau[0]) == pytest.approx(tau, rel=1e-5)
    for j, s in enumerate(slots):
        members = [(e, float(b)) for e, b, t in zip(evicted, best, target) if t == j and b >= tau]
        den = math.e + sum(math.exp(b) for _, b in members)
        expect = (math.e * k[0, 0, s] + sum(math.exp(b) * k[0, 0, e] for e, b in members)) / den
        torch.testing.assert_close(policy.k[0][0, 0, j], expect, atol=1e-5, rtol=1e-5)
    assert any(t for t in target.tolist())  # the case merges something


def test_d2o_merge_false_keeps_the_same_tokens_unmerged():
    """The ablation: the same kept slots as with merging, holding their own K/V, and no decode merge."""
    torch.manual_seed(3)
    T = 16
    q, k, v = torch.randn(1, 2, T, 4), torch.randn(1, 1, T, 4), torch.randn(1, 1, T, 4)
    kept = {}
    for merge in ("true", "false"):
        policy = bare_policy("d2o", f"budget=6,n_sink=1,recent_share=0.2,merge={merge}", n_heads=2, n_kv_heads=1,
                             head_dim=4, T=T)
        policy.prefill(0, q, k, v)
        policy.end_prefill()
        kept[merge] = policy.pos[0][0, 0].tolist()
    assert kept["true"] == kept["false"]
    n = len(kept["false"])
    torch.testing.assert_close(policy.k[0][0, 0, :n], k[0, 0, kept["false"]])
    torch.testing.assert_close(policy.v[0][0, 0, :n], v[0, 0, kept["false"]])
    before = policy.k[0].clone()
    policy.on_evict(0, torch.tensor([[3]]))
    torch.testing.assert_close(policy.k[0], before)


def test_d2o_layer_budgets_split_by_variance_and_sum_to_total(tmp_path):
    _, model = tiny_hf_model("llama31", tmp_path)
    tokens, pos = left_padded([40])
    policy = make_policy("d2o", "budget=16,dense_factor=3,gate=0")        # gate 0: every layer sparse
    with torch.no_grad():
        model.setup_caches(1, 48, policy)
        run_prefill(model, tokens, pos)
    assert policy.budgets == [16, 16]
    variances = policy.variances
    gate = (variances[0] + variances[1]) / 2                         # one dense, one sparse layer
    policy = make_policy("d2o", f"budget=16,dense_factor=3,gate={gate}")
    with torch.no_grad():
        model.setup_caches(1, 48, policy)
        run_prefill(model, tokens, pos)
    dense = 0 if variances[0] <= gate else 1
    assert policy.budgets[dense] == 24 and policy.budgets[1 - dense] == 8 and sum(policy.budgets) == 32
    assert [policy.k[i].shape[2] for i in range(2)] == policy.budgets


def test_d2o_dense_share_picks_the_lowest_variance_layers():
    policy = bare_policy("d2o", "budget=100,dense_factor=2,dense_share=0.25", layers=8)
    variances = [5.0, 300.0, 1.0, 80.0, 900.0, 40.0, 7.0, 60.0]            # lowest two: layers 2 and 0
    assert policy.dense_layers(variances) == [True, False, True, False, False, False, False, False]
    policy.decide(torch.tensor(variances))
    budgets = policy.layer_budgets(100, 20)                                # a row's split of its budget
    assert budgets[0] == budgets[2] == 2 * budgets[1] and sum(budgets) == 800
    assert [v * 10 for v in variances] and policy.dense_layers([v * 10 for v in variances]) == \
        policy.dense_layers(variances)                                   # scale-free: longer prompts, same layers
    assert make_policy("d2o", "gate=50").dense_layers(variances) == [True, False, True, False, False, True, True, False]
    assert make_policy("d2o", "dense_share=0").dense_layers(variances) == [False] * 8
    with pytest.raises(PolicyError, match="dense_share"):
        make_policy("d2o", "dense_share=1.5")


@pytest.mark.parametrize("strategy", ["prefill", "decode"])
def test_simlayerkv_flags_layers_whose_mass_exceeds_delta(strategy, tmp_path):
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([60])
    captured = {}
    policy = make_policy("simlayerkv", f"strategy={strategy},n_recent=8,n_sink=2,obs_window=5")
    hook = "prefill" if strategy == "prefill" else "decode"
    real = getattr(policy, hook)

    def spy(layer, q, k, v):
        out = real(layer, q, k, v)
        if hook == "prefill":
            captured[layer] = (q[0].clone(), k[0].clone())
        elif policy.measuring:
            captured[layer] = (q[0].clone(), policy.k[layer][0, :, :61].clone())
        return out

    setattr(policy, hook, spy)
    with torch.no_grad():
        model.setup_caches(1, 70, policy)
        run_prefill(model, tokens, pos)
        for step in range(3):
            run_decode(model, torch.tensor([[7]]), torch.tensor([[60 + step]]), step)
    masses = []
    for layer in range(2):
        q, k = captured[layer]
        T = k.shape[1]
        probs = naive_probs(q, k) if hook == "prefill" else \
            (torch.einsum("hd,htd->ht", q[:, 0], k.repeat_interleave(3, 0)) / math.sqrt(q.shape[-1])).softmax(-1)[:, None]
        rows = range(T - 5, T) if hook == "prefill" else [0]
        qpos = (lambda i: i) if hook == "prefill" else (lambda i: 60)
        near = lambda i: [j for j in range(T) if j < 2 or j > qpos(i) - 8]          # noqa: E731
        masses.append(sum(float(probs[:, i, near(i)].sum(-1).mean()) for i in rows) / len(rows))
    assert [m[0] for m in policy.decided_masses] == pytest.approx(masses, abs=1e-5)
    for delta in sorted(masses):
        policy.lazy_threshold = delta - 1e-6
        policy.decide(torch.tensor([[m] for m in masses]))
        assert policy.lazy == [m > delta - 1e-6 for m in masses]


@pytest.mark.parametrize("model_type,vocab,window,n_kv_heads,family", [
    ("gemma", 256000, None, 1, "other"),        # not Qwen by its large vocabulary
    ("gemma2", 256000, 4096, 8, "other"),       # nor Mistral by its sliding window
    ("qwen2", 151936, None, 2, "qwen"),
    ("llama", 128256, None, 8, "llama3"),
    ("llama", 151936, None, 2, "llama3"),       # a vocabulary alone never makes a Qwen
    ("llama", 32000, None, 32, "llama2"),
    (None, 32000, None, 8, "mistral"),          # no model type recorded: read as llama
    ("llama", 32000, 4096, 8, "mistral"),
    ("mistral", 131072, None, 8, "mistral"),    # Mistral Nemo: not Llama-3 by its vocabulary
    ("llama", 49152, None, 4, "other"),         # SmolLM2
])
def test_simlayerkv_model_family_comes_from_the_model_type(model_type, vocab, window, n_kv_heads, family):
    cfg = {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 32,
           "num_key_value_heads": n_kv_heads, "intermediate_size": 128, "head_dim": 2, "sliding_window": window}
    if model_type:
        cfg["model_type"] = model_type
    args = ModelArgs.from_hf_config(cfg)
    assert args.model_type == model_type and model_family(args) == family
    policy = make_policy("simlayerkv", "")
    policy.setup(args, 1, 16, torch.float32, "cpu")
    assert policy.lazy_threshold == DELTA_BY_FAMILY[family]


def test_the_gguf_architecture_is_the_model_type():
    meta = {"general.architecture": "mistral", "mistral.attention.head_count": 4, "mistral.embedding_length": 32,
            "mistral.vocab_size": 131072, "mistral.block_count": 1, "mistral.feed_forward_length": 64,
            "mistral.attention.layer_norm_rms_epsilon": 1e-5}
    args = checkpoint.args_from_gguf(meta, {"output.weight"})
    assert args.model_type == "mistral" and model_family(args) == "mistral"
    assert ModelArgs.from_hf_config(args.to_hf_config()).model_type == "mistral"


def test_simlayerkv_lazy_layers_keep_initial_and_recent_ring(tmp_path):
    _, model = tiny_hf_model("llama31", tmp_path)
    tokens, pos = left_padded([50, 30])
    policy = make_policy("simlayerkv", "lazy_threshold=0.01,n_recent=6,n_sink=3")    # every layer lazy
    with torch.no_grad():
        model.setup_caches(2, 70, policy)
        run_prefill(model, tokens, pos)
        for step in range(5):
            run_decode(model, torch.tensor([[7], [8]]), pos[:, -1:] + 1 + step, step)
    assert policy.lazy == [True, True]
    assert all(h == [0, 1, 2] + list(range(49, 55)) for h in kept(policy)[0])
    assert all(h == [0, 1, 2] + list(range(29, 35)) for h in kept(policy)[1])
    assert policy.k[0].shape[2] == 9


@pytest.mark.parametrize("name,args", [
    ("h2o", "budget=64"), ("snapkv", "budget=64,obs_window=8"), ("pyramidkv", "budget=64,obs_window=4,pyramid_beta=1"),
    ("d2o", "budget=64"), ("simlayerkv", "lazy_threshold=1.0"), ("simlayerkv", "strategy=decode,lazy_threshold=1.0"),
    ("simlayerkv", "n_recent=64")])
@pytest.mark.parametrize("kind", ["tied_gqa3", "mistral"])
def test_nothing_evicted_equals_full_cache(name, args, kind, tmp_path):
    """Budgets covering prompt + generation: every policy's storage, masks and decode attention
    (the joint softmax of H2O/D2O included) must reproduce the full cache."""
    _, model = tiny_hf_model(kind, tmp_path)
    tokens, pos = left_padded([17, 9, 12], seed=3)
    follow = torch.randint(0, 128, (3, 8))
    outs = []
    for policy in (None, make_policy(name, args)):
        with torch.no_grad():
            model.setup_caches(3, 64, policy)
            logits = [run_prefill(model, tokens, pos)]
            logits += [run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s) for s in range(8)]
        outs.append(torch.stack(logits, 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,args,message", [
    ("h2o", "budget=10,n_sink=4,n_recent=8", "at least n_sink"),
    ("snapkv", "budget=16,obs_window=32", "at least the obs_window"),
    ("snapkv", "kernel=4", "odd"),
    ("snapkv", "pooling=median", "max or avg"),
    ("pyramidkv", "pyramid_beta=0.5", "beta"),
    ("d2o", "budget=3,n_sink=4", "at least n_sink"),
    ("simlayerkv", "strategy=middle", "prefill or decode"),
    ("simlayerkv", "budget=5", "no parameter"),
    ("h2o", "n_recent=big", "not a valid int")])
def test_bad_policy_arguments_are_clear_errors(name, args, message):
    with pytest.raises(PolicyError, match=message):
        make_policy(name, args)


def test_registry_lists_every_policy_with_declared_parameters():
    assert set(EVICTION) | {"full"} <= set(POLICIES)
    for name in EVICTION:
        for key, (kind, default, help_text) in policy_params(POLICIES[name]).items():
            assert (default is None or isinstance(default, kind)) and help_text    # None: budget, ratio


# --------------------------------------------------------------------------- the real model

def test_first_token_equals_full_under_every_prefill_compression(engine_dir, essay_text):
    model, tok = engine_dir
    ids = tok.encode(essay_text)[:900]
    full = engine.generate(model, tok, [ids, ids[:700]], max_new_tokens=3)   # 3: simlayerkv (decode strategy) trims before step 1
    for name in EVICTION:
        out = engine.generate(model, tok, [ids, ids[:700]], max_new_tokens=3, policy=make_policy(name, small_args(name, 128)))
        assert [t[0] for t in out.tokens] == [t[0] for t in full.tokens], name
        assert out.stats["kv_bytes_allocated"] < full.stats["kv_bytes_allocated"], name


def test_budget_256_allocates_a_tenth_of_full_at_4000_tokens(default_dir):
    """kv_bytes() from the buffers, allocated when the 4000-token prompt arrives."""
    model, _ = engine.load_model(default_dir)
    tokens, pos = torch.randint(0, 1000, (1, 4000)), torch.arange(4000)[None]
    allocated = {}
    for name, args in (("full", None), ("snapkv", "budget=256"), ("streaming", "budget=256")):
        policy = model.setup_caches(1, 4064, make_policy(name, args))
        with torch.inference_mode():
            run_prefill(model, tokens, pos)
        allocated[name] = policy.kv_bytes()["allocated"]
        if name != "full":
            assert allocated[name] == sum(k.numel() * k.element_size() * 2 for k in policy.k)
            assert allocated[name] * 10 <= allocated["full"], name


@pytest.mark.parametrize("name,args,bits", [
    ("h2o", "budget=12,n_sink=2,n_recent=4", 16), ("snapkv", "budget=12,obs_window=4", 16), ("d2o", "budget=14,n_sink=2", 16),
    ("simlayerkv", "strategy=decode,n_recent=6", 16), ("full", "", 4), ("d2o", "budget=14,n_sink=2", 4)])
# (snapkv over KIVI storage compiles in test_model.py's generate() test)
def test_compiled_decode_matches_eager_without_recompiles(name, args, bits, tmp_path):
    """Eviction, merging and joint-softmax decode are sync-free and shape-stable: one compiled
    decode graph serves every step (the decode strategy's measuring step is its own variant).
    bits 4: KIVI storage (G 8, R 16), whose ring wraps and groups fill within the 12 steps; compiled
    and eager scores differ in float rounding, which can move a 4-bit code by one step (1e-3)."""
    from torch._dynamo.utils import counters
    from cache.quantized import with_kv_bits
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([30, 21])
    follow = torch.randint(0, 128, (2, 12))
    step = torch.compile(decode_step, dynamic=True)
    outs = {}
    for mode, decode in (("eager", decode_step), ("compiled", step)):
        with torch.no_grad():
            model.setup_caches(2, 48, with_kv_bits(make_policy(name, args), bits, 8, 16))
            run_prefill(model, tokens, pos)
            logits = []
            for s in range(12):
                if s == 4:
                    graphs = counters["stats"]["unique_graphs"]
                logits.append(run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s, decode))
        outs[mode] = torch.stack(logits)
    assert counters["stats"]["unique_graphs"] == graphs, "decode recompiled while the cache evicted"
    tol = 1e-4 if bits == 16 else 1e-3
    torch.testing.assert_close(outs["compiled"], outs["eager"], atol=tol, rtol=tol)


# --------------------------------------------------------------------------- knorm (a per-token score)

def lowest_norms(norms, candidates, n):
    """The n candidates of lowest key norm (norms [T] of one head), sorted by position."""
    return sorted(sorted(candidates, key=lambda j: float(norms[j]))[:n])


@pytest.mark.parametrize("n_sink,n_recent", [(0, 0), (2, 3)])
def test_knorm_keeps_the_lowest_key_norms_and_evicts_the_highest(n_sink, n_recent):
    """Prefill: per KV head the sinks, the recent window and the lowest-norm keys of the rest; decode: the new
    token is stored and the unprotected kept key of highest norm leaves (the window counts the new token)."""
    torch.manual_seed(5)
    T, budget = 20, 8
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    policy = bare_policy("knorm", f"budget={budget},n_sink={n_sink},n_recent={n_recent}", T=T)
    policy.prefill(0, q, k, v)
    always = set(range(n_sink)) | set(range(T - n_recent, T))
    norms = k[0].norm(dim=-1)                                                    # [2, T]
    expected = [sorted(always | set(lowest_norms(norms[h], set(range(T)) - always, budget - len(always))))
                for h in range(2)]
    assert kept(policy)[0] == expected
    k1 = torch.randn(1, 2, 1, 8)
    policy.begin(torch.tensor([[T]]))
    policy.decode(0, torch.randn(1, 4, 1, 8), k1, torch.randn(1, 2, 1, 8))
    for h in range(2):
        protected = set(range(n_sink)) | set(range(T - n_recent + 1, T))
        worst = max(set(expected[h]) - protected, key=lambda j: float(norms[h, j]))
        assert kept(policy)[0][h] == sorted(set(expected[h]) - {worst}) + [T]
        slot = policy.pos[0][0, h].tolist().index(T)
        assert math.isclose(float(policy.score[0][0, h, slot]), -float(k1[0, h, 0].norm()), rel_tol=1e-6)


@pytest.mark.parametrize("reader", ["quest", "ds"])
def test_knorm_under_a_reader_evicts_as_alone(reader, tmp_path):
    """A reader stores each decode token through the storage's `store` (not its `decode`): the token's
    score must be kept there, so knorm+READER reading every slot keeps and outputs what knorm does alone."""
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([21, 14], seed=4)
    follow = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    runs = []
    for spec in ("knorm", f"knorm+{reader}"):
        read_all = {"n_critical": 64, f"{reader}.n_sink": 2, f"{reader}.n_recent": 4,
                    **({"channels": "prompt"} if reader == "ds" else {})}   # N_c 64 >= the 12 slots
        args = {"budget": 12, **(read_all if "+" in spec else {})}
        policy = make_policy(spec, args)
        with torch.no_grad():
            model.setup_caches(2, 40, policy)
            logits = [run_prefill(model, tokens, pos)]
            logits += [run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s) for s in range(10)]
        runs.append((torch.stack(logits), [kept(policy, layer) for layer in range(model.args.n_layers)]))
    assert runs[1][1] == runs[0][1]
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_into_equals_scatter_in_16_bit_dtypes(dtype):
    """cache.slots.scatter_into (16-bit floats scattered as int16 bits, the fast path on the CPU) writes exactly
    what torch's scatter_ writes, NaN and -0.0 included, with the expanded slot index the slot writes use."""
    from cache.slots import scatter_into
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(3, 2, 40, 8, generator=g).to(dtype)
    src = torch.randn(3, 2, 1, 8, generator=g).to(dtype)
    src[0, 0, 0, :2] = torch.tensor([float("nan"), -0.0])
    slot = torch.randint(0, 40, (3, 2), generator=g)
    at = slot[:, :, None, None].expand(-1, -1, 1, 8)
    want = dst.clone().scatter_(2, at, src)
    scatter_into(dst, 2, at, src.float())              # (a wider src is cast to dst's dtype first)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
