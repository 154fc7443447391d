"""The query-aware sparse readers (ds, quest, hshare) and their composition with storage policies:
selections against hand computations on small tensors, Algorithm 1 on a hand-made matrix, sharing
counts and the query-sharing schedule, equality with the full cache when N_c covers the cache (eager
and compiled, two graph variants and no recompiles across requests with different configurations),
heavy-channel calibration, CLI composition, and the real model."""
import math

import pytest
import torch

import engine
from cache import PolicyError, make_policy
from cache.hshare import HSharePolicy, greedy_sharing, share_roots
from cache.calibration import channel_importance, channels_path, read_channels_file, write_channels_file
from cache.sparse_read import n_sources, parse_ratios
from kernels import dequantize_labels_4bit, quantize_labels_4bit
from model import ModelArgs, Transformer
from runtime.steps import decode_step
from tests.helpers import greedy_logits as run, left_padded, tiny_hf_model


def made_up_args(layers=1, n_heads=4, n_kv_heads=2, head_dim=8):
    return ModelArgs(vocab_size=128, dim=n_heads * head_dim, n_layers=layers, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, intermediate_size=64, head_dim=head_dim, max_position_embeddings=512)


def prefilled(name, args_text, q, k, v, batch=1, max_seq=64, args=None):
    """A reader set up on a made-up model (one layer by default), prompt q/k/v [B, H, T, D] prefilled."""
    args = args or made_up_args(n_heads=q.shape[1], n_kv_heads=k.shape[1], head_dim=q.shape[3])
    policy = make_policy(name, args_text)
    policy.setup(args, batch, max_seq, torch.float32, "cpu")
    T = q.shape[2]
    policy.begin(torch.arange(T)[None].repeat(batch, 1))
    for layer in range(args.n_layers):
        policy.prefill(layer, q, k, v)
    policy.end_prefill()
    return policy


def decode_once(policy, q1, k1, v1, position):
    policy.record_reads = True
    policy.begin(torch.full((q1.shape[0], 1), position))
    return policy.decode(0, q1, k1, v1)


def naive_attention(q, keys, values):
    """q [D], keys/values [n, D] -> softmax(q k / sqrt(D)) v."""
    w = torch.softmax(keys @ q / math.sqrt(q.shape[0]), 0)
    return w @ values


# ------------------------------------------------------------------------------ selections by hand

@pytest.mark.parametrize("label_bits", [16, 4])
def test_ds_selects_sinks_recent_and_top_middle_by_heavy_channel_scores(label_bits):
    torch.manual_seed(0)
    Hq, H, D, T, C, x, y, nc = 4, 2, 8, 40, 2, 2, 3, 10
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    policy = prefilled("ds", f"n_critical={nc},n_sink={x},n_recent={y},heavy_channels={C},label_bits={label_bits},"
                             f"channels=prompt", q, k, v)
    # heavy channels by hand: mean over tokens and the group's query heads of |q_d k_d|
    G = Hq // H
    for h in range(H):
        imp = [sum(abs(float(q[0, h * G + g, t, d] * k[0, h, t, d])) for g in range(G) for t in range(T))
               for d in range(D)]
        assert policy.channel_ids[0, h].tolist() == sorted(range(D), key=lambda d: -imp[d])[:C]
    q1, k1, v1 = torch.randn(1, Hq, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    out = decode_once(policy, q1, k1, v1, T)
    keys = torch.cat([k, k1], 2)[0]                                                   # [H, T + 1, D]
    values = torch.cat([v, v1], 2)[0]
    for h in range(H):
        ch = policy.channel_ids[0, h]
        labels = keys[h][:, ch]
        if label_bits == 4:
            labels = dequantize_labels_4bit(*quantize_labels_4bit(labels))
        qsum = sum(q1[0, h * G + g, 0, ch] for g in range(G))
        score = [float(qsum @ labels[s]) for s in range(T + 1)]
        forced = [s for s in range(T + 1) if s < x or s > T - y]
        middle = sorted((s for s in range(T + 1) if s not in forced), key=lambda s: -score[s])[:nc - x - y]
        expected = sorted(forced + middle)
        assert policy.read_positions(0)[0][h] == expected
        for g in range(G):   # exact attention over exactly those tokens
            ref = naive_attention(q1[0, h * G + g, 0], keys[h][expected], values[h][expected])
            torch.testing.assert_close(out[0, h * G + g, 0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("agg", ["max", "query"])
def test_ds_head_aggregation_max_and_per_query_head_lists(agg):
    """max: a KV head reads the middle tokens with the largest score of any of its query heads; query:
    every query head reads its own N_c tokens (Hidx = H_q) and attends exactly over them."""
    torch.manual_seed(3)
    Hq, H, D, T, C, x, y, nc = 4, 2, 8, 40, 2, 2, 3, 10
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    policy = prefilled("ds", f"n_critical={nc},n_sink={x},n_recent={y},heavy_channels={C},label_bits=16,"
                             f"channels=prompt,head_agg={agg}", q, k, v)
    q1, k1, v1 = torch.randn(1, Hq, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    out = decode_once(policy, q1, k1, v1, T)
    keys, values = torch.cat([k, k1], 2)[0], torch.cat([v, v1], 2)[0]
    G = Hq // H
    reads = policy.read_positions(0)[0]
    assert len(reads) == (Hq if agg == "query" else H)
    forced = [s for s in range(T + 1) if s < x or s > T - y]
    for r, head_reads in enumerate(reads):
        h = r // G if agg == "query" else r
        labels = keys[h][:, policy.channel_ids[0, h]]
        per_query = [[float(q1[0, h * G + g, 0, policy.channel_ids[0, h]] @ labels[s]) for s in range(T + 1)]
                     for g in range(G)]
        score = per_query[r % G] if agg == "query" else [max(col) for col in zip(*per_query)]
        middle = sorted((s for s in range(T + 1) if s not in forced), key=lambda s: -score[s])[:nc - x - y]
        expected = sorted(forced + middle)
        assert head_reads == expected
        for g in ([r % G] if agg == "query" else range(G)):
            ref = naive_attention(q1[0, h * G + g, 0], keys[h][expected], values[h][expected])
            torch.testing.assert_close(out[0, h * G + g, 0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("agg", ["mean", "max"])
def test_hshare_critical_sets_rank_as_decode_does(agg):
    """The similarity sets (last prompt queries' top-z middle tokens) aggregate each KV head's query
    heads as decode's selection does: head_agg=max by the group's largest score, not its sum."""
    torch.manual_seed(11)
    Hq, H, D, T, C, x, y, nc, w = 4, 2, 8, 40, 2, 2, 3, 10, 4
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    policy = prefilled("hshare", f"n_critical={nc},n_sink={x},n_recent={y},heavy_channels={C},label_bits=16,"
                                 f"channels=prompt,head_agg={agg},ratios=1/2-1-1,sim_queries={w}",
                       q, k, v, args=made_up_args(layers=2, n_heads=Hq, n_kv_heads=H, head_dim=D))
    ids, ok = policy.critical_sets(0)                                          # [1, H, w, z]
    G, z, reduce = Hq // H, nc - x - y, (max if agg == "max" else sum)
    for h in range(H):
        ch = policy.channel_ids[0, h]
        for i, t in enumerate(range(T - w, T)):
            score = {s: reduce(float(q[0, h * G + g, t, ch] @ k[0, h, s, ch]) for g in range(G))
                     for s in range(x, t - y + 1)}
            expected = sorted(score, key=lambda s: -score[s])[:z]
            assert sorted(ids[0, h, i][ok[0, h, i]].tolist()) == sorted(expected)


def test_quest_reads_sinks_recent_and_the_pages_of_highest_upper_bound():
    torch.manual_seed(1)
    Hq, H, D, T, ps = 4, 2, 8, 39, 4          # 40 tokens after the decode step = 10 pages of 4
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    policy = prefilled("quest", f"n_critical=16,n_sink=4,n_recent=4,page_size={ps}", q, k, v)
    q1, k1, v1 = torch.randn(1, Hq, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    decode_once(policy, q1, k1, v1, T)
    keys = torch.cat([k, k1], 2)[0]
    G = Hq // H
    for h in range(H):
        bound = []
        for p in range(10):
            page = keys[h, p * ps:(p + 1) * ps]
            mn, mx = page.min(0).values, page.max(0).values
            bound.append(sum(float(torch.maximum(q1[0, h * G + g, 0] * mn, q1[0, h * G + g, 0] * mx).sum())
                             for g in range(G)))
        pages = sorted(range(1, 9), key=lambda p: -bound[p])[:2]     # page 0 = sinks, page 9 = recent
        expected = sorted(s for p in [0, 9] + pages for s in range(p * ps, (p + 1) * ps))
        assert policy.read_positions(0)[0][h] == expected


def test_reader_positions_come_from_the_storage_left_padding_and_sliding_window():
    """Sinks are the sequence's first tokens (not the padding slots), recent ones end at its current
    token, and nothing beyond the sliding window is read."""
    torch.manual_seed(2)
    lengths = [30, 21]
    _, pos = left_padded(lengths)
    T = pos.shape[1]
    def one_decode_step(sliding_window):
        args = made_up_args()
        args.sliding_window = sliding_window
        policy = make_policy("ds", "n_critical=8,n_sink=2,n_recent=3,heavy_channels=2")
        policy.setup(args, 2, 64, torch.float32, "cpu")
        policy.begin(pos)
        policy.prefill(0, torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8))
        policy.end_prefill()
        policy.record_reads = True
        policy.begin(pos[:, -1:] + 1)
        policy.decode(0, torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
        return policy.read_positions(0)

    windowed, unbounded = one_decode_step(12), one_decode_step(None)
    for b, n in enumerate(lengths):
        for read in windowed[b]:
            assert len(read) == 8 and set(read) >= {n - 2, n - 1, n}           # recent, current included
            assert all(n - p < 12 for p in read)                                # inside the window
        for read in unbounded[b]:
            assert {0, 1, n - 2, n - 1, n} <= set(read) and min(read) >= 0


# ------------------------------------------------------------------------------ Algorithm 1

def test_greedy_sharing_follows_algorithm_1_on_a_hand_made_matrix():
    S = torch.zeros(5, 5)
    for (i, j), s in {(1, 0): .9, (2, 0): .2, (2, 1): .3, (3, 0): .1, (3, 1): .8, (3, 2): .4,
                      (4, 0): .5, (4, 1): .6, (4, 2): .95, (4, 3): .7}.items():
        S[i, j] = s
    S[0, 4] = 5.0                         # above the diagonal: never used (sources come earlier)
    assert greedy_sharing(S, 0) == [0, 1, 2, 3, 4]
    assert greedy_sharing(S, 1) == [0, 1, 2, 3, 2]        # (4, 2) = .95
    assert greedy_sharing(S, 2) == [0, 0, 2, 3, 2]        # then (1, 0) = .9; row/col 4 cleared
    assert greedy_sharing(S, 3) == [0, 0, 2, 2, 2]        # (3, 1) is gone with column 1: (3, 2) = .4
    assert greedy_sharing(S, 4) == [0, 0, 0, 2, 2]        # (2, 0) = .2: layer 2 shares after being a source
    assert share_roots([0, 0, 0, 2, 2]) == [0, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        greedy_sharing(S, 5)


@pytest.mark.parametrize("ratio_, n, sources", [(0.75, 30, 23), (7 / 8, 30, 26), (0.5, 30, 15), (1.0, 30, 30),
                                                (0.75, 3, 2), (0.5, 3, 2), (0.25, 3, 1), (0.01, 4, 1)])
def test_sharing_ratio_gives_round_ratio_n_sources(ratio_, n, sources):
    assert n_sources(ratio_, n) == sources


def test_parse_ratios_and_arguments():
    assert parse_ratios("3/4-3/4-1/2") == (0.75, 0.75, 0.5)
    p = make_policy("hshare", "ratios=7/8-3/4-1/4")
    assert (p.layer_ratio, p.head_ratio, p.query_ratio, p.a) == (0.875, 0.75, 0.25, 4)
    p = make_policy("hshare", "preset=short")
    assert (p.n_critical, p.n_sink, p.n_recent) == (128, 8, 32)
    p = make_policy("hshare", "preset=long,n_sink=4")
    assert (p.n_critical, p.n_sink, p.n_recent) == (512, 4, 64)
    for bad in ("ratios=1-1", "layer_ratio=0", "ratios=1-1-1,query_ratio=1", "sharing=best", "n_critical=8,n_sink=4,n_recent=5",
                "n_recent=0", "label_bits=8"):
        with pytest.raises(PolicyError):
            make_policy("hshare", bad)


# ------------------------------------------------------------------------------ composition parsing

def test_composition_routes_arguments_and_rejects_what_cannot_compose():
    p = make_policy("snapkv+hshare", "budget=256,obs_window=16,preset=short,snapkv.kernel=5,hshare.seed=3")
    assert type(p).__name__ == "HSharePolicy" and p.inner.name == "snapkv"
    assert (p.inner.budget, p.inner.obs_window, p.inner.kernel, p.n_critical, p.seed) == (256, 16, 5, 128, 3)
    assert make_policy("full+ds").inner.name == "full"
    with pytest.raises(PolicyError, match="both"):
        make_policy("h2o+hshare", "n_sink=4")                     # declared by h2o and hshare
    for name in ("h2o+hshare", "d2o+ds"):
        with pytest.raises(PolicyError, match="attention probabilities"):
            make_policy(name)
    with pytest.raises(PolicyError, match="'strategy': 'decode'.*cannot be combined with a sparse reader"):
        make_policy("simlayerkv+quest", "strategy=decode")          # the default: needs a full decode step
    assert make_policy("simlayerkv+quest", "strategy=prefill").inner.strategy == "prefill"
    for name in ("hshare+snapkv", "ds+hshare", "snapkv+pyramidkv", "snapkv+hshare+ds", "nope+ds"):
        with pytest.raises(PolicyError):
            make_policy(name)
    with pytest.raises(PolicyError, match="no parameter"):
        make_policy("snapkv+hshare", "bogus=1")
    with pytest.raises(PolicyError, match="not one of"):
        make_policy("snapkv+hshare", "h2o.budget=3")


# ------------------------------------------------------------------------------ tiny models, end to end

@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return {kind: tiny_hf_model(kind, tmp_path_factory.mktemp(kind))[1] for kind in ("tied_gqa3", "mistral")}


READ_ALL = [("ds", "n_critical=64,n_sink=2,n_recent=4"),
            ("quest", "n_critical=64,n_sink=2,n_recent=4,page_size=4"),
            ("hshare", "n_critical=64,n_sink=2,n_recent=4,ratios=1/2-1/2-1/2,label_bits=4"),
            ("hshare", "n_critical=64,n_sink=2,n_recent=4,ratios=1-1-1/3,sharing=random"),
            ("snapkv+hshare", "budget=64,n_critical=64,n_sink=2,n_recent=4,ratios=1/2-1/2-1/2"),
            ("streaming+quest", "budget=64,quest.n_sink=2,n_recent=4,n_critical=64")]


@pytest.mark.parametrize("kind", ["tied_gqa3", "mistral"])
def test_reading_every_token_equals_the_full_cache(tiny_models, kind):
    """N_c >= the cache: logits of every decode step equal the full cache's (left-padded batch; the
    mistral model has a sliding window of 8, so reuse steps must drop tokens that left it)."""
    model = tiny_models[kind]
    tokens, pos = left_padded([30, 19], seed=3)
    ref = run(model, None, tokens, pos)
    for name, args_text in READ_ALL:
        got = run(model, make_policy(name, args_text), tokens, pos)
        assert (got - ref).abs().max() < 1e-5, (name, args_text)


def test_hshare_without_sharing_selects_exactly_what_ds_selects(tiny_models):
    model = tiny_models["tied_gqa3"]
    tokens, pos = left_padded([34, 27], seed=4)
    reads = {}

    def recorder(name):
        def on_step(i, cache, p):
            reads.setdefault(name, []).append([cache.read_positions(layer) for layer in range(2)])
        return on_step

    logits = {}
    for name, extra in [("ds", ""), ("hshare", ",ratios=1-1-1")]:
        policy = make_policy(name, "n_critical=12,n_sink=2,n_recent=3,heavy_channels=4" + extra)
        policy.record_reads = True
        logits[name] = run(model, policy, tokens, pos, on_step=recorder(name))
    assert reads["ds"] == reads["hshare"]
    assert torch.equal(logits["ds"], logits["hshare"])
    assert len(reads["ds"][0][0][0][0]) == 12                 # really sparse: 12 of 35+ tokens


def test_sharing_counts_schedule_and_current_token(monkeypatch):
    """8 layers, 4 KV heads, ratios 3/4-1/2-1/3: 6 layers and 2 heads per layer select, only at decode
    steps 0, 3, 6; reuse steps read the select step's tokens plus every token generated since."""
    torch.manual_seed(5)
    args = made_up_args(layers=8, n_heads=8, n_kv_heads=4, head_dim=16)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    tokens, pos = left_padded([40, 33], seed=5)
    calls = []
    orig = HSharePolicy.own_selection

    def counting(self, layer, q):
        calls.append(layer)
        return orig(self, layer, q)
    monkeypatch.setattr(HSharePolicy, "own_selection", counting)
    policy = make_policy("hshare", "n_critical=12,n_sink=2,n_recent=3,ratios=3/4-1/2-1/3")
    policy.record_reads = True
    per_step, reads = [], []

    def on_step(i, cache, p):
        per_step.append(len(calls))
        reads.append([cache.read_positions(layer) for layer in range(8)])
        for layer in range(8):      # the current token is always read, by every head of every row
            for b in range(2):
                for head in reads[-1][layer][b]:
                    assert int(p[b, 0]) in head
    run(model, policy, tokens, pos, steps=7, on_step=on_step, max_seq=64)
    assert sum(r == i for i, r in enumerate(policy.roots)) == 6
    assert all(sum(r == h for h, r in enumerate(roots)) == 2 for roots in policy.head_roots)
    assert all(policy.roots[i] <= i for i in range(8))
    assert all(r <= h for roots in policy.head_roots for h, r in enumerate(roots))
    selected = [b - a for a, b in zip([0] + per_step, per_step)]
    assert selected == [6, 0, 0, 6, 0, 0, 6]
    for step in (1, 2):
        for layer in range(8):
            for b in range(2):
                for h in range(4):
                    new = {int(pos[b, -1]) + 1 + s for s in range(1, step + 1)}
                    assert set(reads[step][layer][b][h]) == set(reads[0][layer][b][h]) | new
    for layer in range(8):          # a sharing layer reads its root's tokens, a sharing head its root head's
        root = policy.roots[layer]
        for b in range(2):
            for h in range(4):
                rh = policy.head_roots[root][h]
                assert reads[0][layer][b][h] == reads[0][root][b][rh]


def test_snapkv_hshare_shares_positions_across_layers_that_keep_different_tokens():
    """Under SnapKV every (layer, head) keeps its own tokens in its own slot order: a sharing layer
    reads its root's *positions*, restricted to what it keeps."""
    torch.manual_seed(6)
    args = made_up_args(layers=4, n_heads=6, n_kv_heads=3, head_dim=16)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    tokens, pos = left_padded([48, 40], seed=6)
    policy = make_policy("snapkv+hshare", "budget=24,obs_window=4,n_critical=10,n_sink=2,n_recent=3,"
                                          "ratios=1/2-2/3-1/2")
    policy.record_reads = True
    seen = []

    def on_step(i, cache, p):
        if i == 0:
            for layer in range(4):
                kept = [[set(h) for h in row] for row in cache.inner.kept_positions(layer).tolist()]
                seen.append((layer, cache.read_positions(layer), kept))
    run(model, policy, tokens, pos, steps=3, on_step=on_step)
    reads = {layer: r for layer, r, _ in seen}
    for layer, read, kept in seen:
        root = policy.roots[layer]
        for b in range(2):
            for h in range(3):
                assert set(read[b][h]) <= kept[b][h]
                if root != layer:
                    rh = policy.head_roots[root][h]
                    assert set(read[b][h]) == set(reads[root][b][rh]) & kept[b][h]


def test_compiled_decode_has_two_variants_and_serves_every_configuration(tiny_models):
    """Select and reuse steps are the only graphs; new requests with other sharing configurations
    (different prompts, random sharing seeds) run without recompiling, with the eager logits."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()       # graphs of decode_step compiled by earlier tests in this process would be reused
    torch.manual_seed(7)
    args = made_up_args(layers=3, n_heads=6, n_kv_heads=3, head_dim=16)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    compiled = torch.compile(decode_step, dynamic=True)
    configs, graphs = set(), []
    for seed, lengths in enumerate([[30, 22], [40, 33], [26, 26]]):
        tokens, pos = left_padded(lengths, seed=seed)
        text = f"n_critical=12,n_sink=2,n_recent=3,ratios=2/3-2/3-1/2,sharing=random,seed={seed}"
        ref = run(model, make_policy("hshare", text), tokens, pos, steps=5)
        before = counters["stats"]["unique_graphs"]
        policy = make_policy("hshare", text)
        got = run(model, policy, tokens, pos, steps=5, decode=compiled)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        configs.add((tuple(policy.roots), tuple(map(tuple, policy.head_roots))))
        assert (got - ref).abs().max() < 1e-5
    assert graphs == [2, 0, 0] and len(configs) > 1


# ------------------------------------------------------------------------------ heavy channels

def test_calibration_file_round_trip_and_policy_source(tmp_path):
    args = made_up_args(layers=2)
    ranking = torch.stack([torch.stack([torch.randperm(8) for _ in range(2)]) for _ in range(2)])
    path = write_channels_file(tmp_path / "hc.json", ranking, torch.rand(2, 2, 8), {"data": "test"})
    assert torch.equal(read_channels_file(path, args), ranking)
    with pytest.raises(ValueError, match="calibrated for"):
        read_channels_file(path, made_up_args(layers=3))
    assert channels_path("x/model.Q4_1.gguf").name == "model.Q4_1.heavy_channels.json"
    assert channels_path("x/dir") == channels_path("x/dir/")
    # channels=auto finds the file next to the checkpoint (engine.load_model records the path in args)
    (tmp_path / "ckpt").mkdir()
    write_channels_file(channels_path(tmp_path / "ckpt"), ranking, torch.rand(2, 2, 8), {})
    args.checkpoint = str(tmp_path / "ckpt")
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    policy = prefilled("hshare", "heavy_channels=3,label_bits=16", q, k, v, args=args)
    assert policy.describe()["heavy_channels_source"].startswith("calibrated")
    assert torch.equal(policy.channel_ids.cpu(), ranking[:, :, :3])
    args.checkpoint = str(tmp_path)            # no file there: prompt statistics
    policy = prefilled("ds", "heavy_channels=3,label_bits=16", q, k, v, args=args)
    assert policy.describe()["heavy_channels_source"].startswith("prompt")


def test_calibration_statistic_and_script_on_a_tiny_model(tiny_models):
    from cache.calibration import calibrate_channels as calibrate
    torch.manual_seed(8)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    pos = torch.tensor([[-1, 0, 1, 2, 3]])
    total = channel_importance(q, k, pos)
    manual = sum((q[0, h * 2 + g, t] * k[0, h, t]).abs() for g in range(2) for t in range(1, 5) for h in [0])
    torch.testing.assert_close(total[0], manual)
    model = tiny_models["tied_gqa3"]
    ranking, mean = calibrate(model, [list(range(1, 33)), list(range(40, 72))])
    assert ranking.shape == mean.shape == (2, 2, 16)
    assert torch.equal(ranking, torch.sort(mean, dim=-1, descending=True, stable=True).indices)


# ------------------------------------------------------------------------------ the real model

@pytest.mark.model
def test_real_model_first_token_equals_full_and_sparse_decode_reads_n_c(engine_dir, essay_text):
    model, tokenizer = engine_dir
    prompt = essay_text[:3000] + "\n\nSummarize the text above in one sentence:"
    full = engine.generate(model, tokenizer, [prompt], max_new_tokens=6)
    for name, args_text in [("hshare", "preset=short,ratios=3/4-3/4-1/2"), ("ds", "preset=short,label_bits=4"),
                            ("quest", "preset=short")]:
        res = engine.generate(model, tokenizer, [prompt], max_new_tokens=6, policy=make_policy(name, args_text))
        assert res.tokens[0][0] == full.tokens[0][0], name
        if name != "quest":     # generate() prepared the policy: heavy channels calibrated beside the checkpoint
            assert res.stats["policy"]["heavy_channels_source"] == f"calibrated: {channels_path(model.args.checkpoint)}"
        read = model.cache.kv_bytes()["read_per_step"]
        assert read < 0.5 * full.stats["kv_bytes_live"], name       # N_c = 128 of ~700 tokens
    desc = res.stats["policy"]
    assert desc["policy"] == "quest" and desc["n_critical"] == 128


@pytest.mark.model
def test_real_model_snapkv_hshare_composition_through_the_cli(default_dir, essay_text, capsys):
    prompt = essay_text[:2500] + "\n\nWhat is the essay about?"
    code = engine.main(["--checkpoint", str(default_dir), "--policy", "snapkv+hshare", "--policy-args",
                        "budget=512,preset=short", "--prompt", prompt, "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "decode" in captured.err and captured.out.strip()
