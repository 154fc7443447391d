"""POD: the JS similarity and Algorithm 1 against hand computations, the gated combination against
one softmax over [proximal own logits; shared distant logits] (Appendix A.1), equality with the full
cache when every layer is its own block (tiny random model and the real one), what each layer
stores and kv_bytes() against the formula, tau skipping and its counter, the SnapKV-style prefill
selection shared by a block, the calibration file and script, and the compiled decode step."""
import json
import math

import pytest
import torch

from cache import PolicyError, make_policy
from cache.calibration import (calibrate_pod, greedy_blocks, js_similarity, key_saving, pod_path, read_pod_file,
                               similarity_sums, write_pod_file)
from model import ModelArgs
from runtime.steps import decode_step, run_decode, run_prefill
from tests.helpers import left_padded, tiny_hf_model


def made_up_args(layers=3, n_heads=4, n_kv_heads=2, head_dim=8):
    return ModelArgs(vocab_size=16, dim=n_heads * head_dim, n_layers=layers, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, intermediate_size=8, head_dim=head_dim, max_position_embeddings=512)


def blocks_file(tmp_path, blocks, layers):
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps({"format": "pod-blocks/1", "n_layers": layers, "n_kv_heads": len(blocks),
                                "blocks": blocks}))
    return path


# --------------------------------------------------------------------------- calibration pieces

def test_js_similarity_is_one_minus_jsd_base_2():
    p = torch.tensor([1.0, 0.0])
    q = torch.tensor([0.5, 0.5])
    m = [0.75, 0.25]
    jsd = 0.5 * math.log2(1 / m[0]) + 0.5 * (0.5 * math.log2(0.5 / m[0]) + 0.5 * math.log2(0.5 / m[1]))
    assert float(js_similarity(p, q)) == pytest.approx(1 - jsd, abs=1e-6)
    assert float(js_similarity(q, q)) == pytest.approx(1.0)
    assert float(js_similarity(torch.tensor([1.0, 0, 0]), torch.tensor([0, 0.5, 0.5]))) == pytest.approx(0.0, abs=1e-6)


def test_similarity_sums_average_rows_and_query_heads_of_each_kv_head():
    torch.manual_seed(0)
    B, H, G, n, T, L = 2, 2, 3, 4, 9, 3
    rows = [torch.rand(B, H, G, n, T).softmax(-1) for _ in range(L)]
    valid = torch.tensor([[True] * 4, [False, True, True, True]])     # one padding query row
    sums, count = similarity_sums(rows, valid)
    assert count == 7 * G
    for h in range(H):
        for a in range(L):
            for b in range(L):
                terms = [float(js_similarity(rows[a][i, h, g, r], rows[b][i, h, g, r]))
                         for i in range(B) for g in range(G) for r in range(n) if valid[i, r]]
                assert float(sums[h, a, b]) / count == pytest.approx(sum(terms) / len(terms), abs=1e-6)


def test_greedy_grouping_needs_similarity_to_every_layer_of_the_block():
    sim = torch.eye(5)
    for a, b, s in [(1, 0, 0.9), (2, 1, 0.9), (2, 0, 0.4), (3, 2, 0.6), (4, 3, 0.6), (4, 2, 0.7)]:
        sim[a, b] = sim[b, a] = s
    # layer 2 is similar to 1 but not to 0: it opens a block; 3 and 4 join it (4 ~ 3 and 4 ~ 2)
    assert greedy_blocks(sim, 0.5) == [[0, 1], [2, 3, 4]]
    assert greedy_blocks(sim, 0.35) == [[0, 1, 2], [3, 4]]                # 3 ~ 0 fails (0.0)
    assert greedy_blocks(sim, 1.01) == [[i] for i in range(5)]
    assert greedy_blocks(sim, 0.0) == [[0, 1, 2, 3, 4]]
    blocks = [greedy_blocks(sim, 0.5), greedy_blocks(sim, 1.01)]
    assert key_saving(blocks, 5) == pytest.approx((10 - 7) / 20)
    assert key_saving(blocks, 5, capacity=100, proximal=20) == pytest.approx(3 / 20 * 0.8)


def test_calibration_file_regroups_with_the_policy_delta_and_checks_the_model(tmp_path):
    sim = torch.eye(3)[None].repeat(2, 1, 1)
    sim[0, 1, 0] = sim[0, 0, 1] = 0.6
    data = write_pod_file(tmp_path / "c.json", sim, {"samples": 1}, deltas=(0.5, 0.7))
    assert data["groupings"]["0.5"]["blocks"] == [[[0, 1], [2]], [[0], [1], [2]]]
    args = made_up_args(layers=3, n_kv_heads=2)
    assert read_pod_file(tmp_path / "c.json", args, 0.5)[0] == [[[0, 1], [2]], [[0], [1], [2]]]
    assert read_pod_file(tmp_path / "c.json", args, 0.7)[0] == [[[0], [1], [2]]] * 2
    with pytest.raises(ValueError, match="calibrated for"):
        read_pod_file(tmp_path / "c.json", made_up_args(layers=4), 0.5)
    bad = blocks_file(tmp_path, [[[0], [2]], [[0, 1, 2]]], 3)
    with pytest.raises(ValueError, match="consecutive blocks"):
        read_pod_file(bad, args, 0.5)


@pytest.mark.parametrize("args,message", [("n_recent=0", "n_recent"), ("tau=1.5", "tau"),
                                          ("blocks=/no/such.json", "no such file"), ("kernel=4", "odd"),
                                          ("sim_threshold=x", "not a valid float")])
def test_bad_arguments_are_clear_errors(args, message):
    with pytest.raises(PolicyError, match=message):
        make_policy("pod", args)


# --------------------------------------------------------------------------- the gate (Appendix A.1)

class Recorder:
    """Runs a bare pod policy on random q/k/v for every layer and keeps what a reference needs."""

    def __init__(self, policy, args, T, batch=1, max_seq=64, seed=0):
        self.policy, self.args = policy, args
        self.g = torch.Generator().manual_seed(seed)
        policy.setup(args, batch, max_seq, torch.float32, "cpu")
        B, Hq, H, D = batch, args.n_heads, args.n_kv_heads, args.head_dim
        self.k = [torch.randn(B, H, T, D, generator=self.g) for _ in range(args.n_layers)]
        self.v = [torch.randn(B, H, T, D, generator=self.g) for _ in range(args.n_layers)]
        q = [torch.randn(B, Hq, T, D, generator=self.g) for _ in range(args.n_layers)]
        policy.before_prefill(torch.arange(T)[None].repeat(B, 1))
        policy.begin(torch.arange(T)[None].repeat(B, 1))
        for layer in range(args.n_layers):
            policy.prefill(layer, q[layer], self.k[layer], self.v[layer])
        policy.end_prefill()
        self.t = T

    def step(self):
        """One decode step: returns (q per layer [B, Hq, D], out per layer [B, Hq, D])."""
        p, a = self.policy, self.args
        B = self.k[0].shape[0]
        p.begin(torch.full((B, 1), self.t))
        qs, outs = [], []
        for layer in range(a.n_layers):
            q = torch.randn(B, a.n_heads, 1, a.head_dim, generator=self.g)
            k = torch.randn(B, a.n_kv_heads, 1, a.head_dim, generator=self.g)
            v = torch.randn(B, a.n_kv_heads, 1, a.head_dim, generator=self.g)
            self.k[layer] = torch.cat([self.k[layer], k], 2)
            self.v[layer] = torch.cat([self.v[layer], v], 2)
            qs.append(q[:, :, 0])
            outs.append(p.decode(layer, q, k, v)[:, :, 0])
        self.t += 1
        return qs, outs


def one_softmax_reference(rec, qs, head_blocks, n_sink, n_recent, b=0):
    """Per layer and query head: one softmax over [own proximal logits; distant logits of the
    block's first layer (its query, its keys)], times the layer's own values (written with loops)."""
    a = rec.args
    G, D, t = a.n_heads // a.n_kv_heads, a.head_dim, rec.t - 1       # t: the current position
    proximal = [j for j in range(t + 1) if j < n_sink or j > t - n_recent]
    distant = [j for j in range(t + 1) if j not in proximal]
    out = torch.zeros(a.n_layers, a.n_heads, D)
    for layer in range(a.n_layers):
        for hq in range(a.n_heads):
            h = hq // G
            first = next(blk[0] for blk in head_blocks[h] if layer in blk)
            logits = [float(qs[layer][b, hq] @ rec.k[layer][b, h, j]) / math.sqrt(D) for j in proximal]
            logits += [float(qs[first][b, hq] @ rec.k[first][b, h, j]) / math.sqrt(D) for j in distant]
            w = torch.tensor(logits, dtype=torch.float64).softmax(0)
            vals = rec.v[layer][b, h, proximal + distant].double()
            out[layer, hq] = (w[:, None] * vals).sum(0).float()
    return out


def test_gated_output_equals_one_softmax_over_proximal_and_shared_distant_scores(tmp_path):
    args = made_up_args(layers=4, n_heads=6, n_kv_heads=2, head_dim=8)
    head_blocks = [[[0, 1, 2], [3]], [[0], [1, 2, 3]]]
    policy = make_policy("pod", f"n_sink=2,n_recent=4,blocks={blocks_file(tmp_path, head_blocks, 4)}")
    rec = Recorder(policy, args, T=20)
    for _ in range(6):                  # tokens keep leaving the ring into the distant store
        qs, outs = rec.step()
        ref = one_softmax_reference(rec, qs, head_blocks, 2, 4)
        torch.testing.assert_close(torch.stack(outs)[:, 0], ref, atol=1e-5, rtol=1e-5)


def test_keys_of_distant_tokens_live_only_in_the_first_layer_of_each_block(tmp_path):
    args = made_up_args(layers=4, n_heads=6, n_kv_heads=2, head_dim=8)
    head_blocks = [[[0, 1, 2], [3]], [[0], [1, 2, 3]]]
    policy = make_policy("pod", f"n_sink=2,n_recent=4,blocks={blocks_file(tmp_path, head_blocks, 4)}")
    rec = Recorder(policy, args, T=20, batch=2, max_seq=40)
    for _ in range(3):
        rec.step()
    everything = list(range(23))
    proximal = [0, 1, 19, 20, 21, 22]
    for layer in range(4):
        kept = policy.kept_positions(layer)
        keys = policy.key_positions(layer)
        for b in range(2):
            for h in range(2):
                assert sorted(p for p in kept[b, h].tolist() if p >= 0) == everything         # values: all
                first = any(blk[0] == layer for blk in head_blocks[h])
                assert sorted(p for p in keys[b, h].tolist() if p >= 0) == (everything if first else proximal)
    # bytes: every value, ring keys everywhere, distant keys in 2 + 2 of the 8 (layer, head) pairs
    B, H, D, C, R, bytes_ = 2, 2, 8, 40, 6, 4
    full = 2 * 4 * B * H * C * D * bytes_
    kv = policy.kv_bytes()
    assert kv["allocated"] == full - 4 * B * (C - R) * D * bytes_
    assert kv["allocated"] == sum(t.numel() * t.element_size() for ts in (policy.ring_k, policy.ring_v,
                                                                          policy.dist_k, policy.dist_v)
                                  for t in ts if t is not None)
    assert 1 - kv["allocated"] / full == pytest.approx(key_saving(head_blocks, 4, C, R))
    assert kv["live"] == 23 / C * full - 4 * B * (23 - R) * D * bytes_


def test_tau_skips_distant_attention_in_non_first_layers_and_counts_it(tmp_path):
    args = made_up_args(layers=3, n_heads=4, n_kv_heads=2, head_dim=8)
    head_blocks = [[[0, 1, 2]], [[0], [1, 2]]]
    path = blocks_file(tmp_path, head_blocks, 3)
    outs = {}
    for tau in (-1.0, 0.0, 1.0):
        policy = make_policy("pod", f"n_sink=2,n_recent=4,blocks={path},tau={tau}")
        rec = Recorder(policy, args, T=20, seed=1)
        qs, outs[tau] = rec.step()
        if tau == 0.0:
            # every non-first (layer, KV head) uses proximal tokens only: 3 of the 6 pairs x 2 query heads
            assert policy.skip_fraction() == 1.0 and int(policy.gated) == 3 * 2
            for layer, h in [(1, 0), (2, 0), (2, 1)]:
                G, D = 2, 8
                for hq in range(h * G, h * G + G):
                    prox = [0, 1, 17, 18, 19, 20]
                    w = torch.tensor([float(qs[layer][0, hq] @ rec.k[layer][0, h, j]) / math.sqrt(D) for j in prox]).softmax(0)
                    expect = (w[:, None] * rec.v[layer][0, h, prox]).sum(0)
                    torch.testing.assert_close(outs[tau][layer][0, hq], expect, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[tau][1][:, 2:], outs[-1.0][1][:, 2:])     # layer 1 head 1 is first
        if tau == 1.0:
            assert policy.skip_fraction() == 0.0
    torch.testing.assert_close(torch.stack(outs[1.0]), torch.stack(outs[-1.0]))
    assert make_policy("pod", "").describe()["tau"] == -1.0


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("kind", ["tied_gqa3", "mistral"])
@pytest.mark.parametrize("args", ["n_sink=2,n_recent=5,blocks=layers", "n_sink=3,n_recent=4,sim_threshold=1.5,blocks=prompt"])
def test_every_layer_its_own_block_equals_full_cache(kind, args, tmp_path):
    _, model = tiny_hf_model(kind, tmp_path)
    tokens, pos = left_padded([30, 21, 12], seed=3)
    follow = torch.randint(0, 128, (3, 12))
    outs = []
    for policy in (None, make_policy("pod", args)):
        with torch.no_grad():
            model.setup_caches(3, 48, policy)
            logits = [run_prefill(model, tokens, pos)]
            logits += [run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s) for s in range(12)]
        outs.append(torch.stack(logits, 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert policy.describe()["blocks_per_head"] == [2, 2]


def test_snapkv_selection_is_made_by_the_first_layer_and_shared_by_its_block(tmp_path):
    """POD+SnapKV: per KV head, the block's first layer keeps the top distant prompt tokens by
    SnapKV's pooled window scores; the other layers of the block keep the same tokens."""
    from cache.scoring import column_scores, pool1d
    args = made_up_args(layers=3, n_heads=4, n_kv_heads=2, head_dim=8)
    head_blocks = [[[0, 1, 2]], [[0], [1, 2]]]
    policy = make_policy("pod", f"n_sink=2,n_recent=4,budget=12,obs_window=3,kernel=3,"
                                f"blocks={blocks_file(tmp_path, head_blocks, 3)}")
    seen = {}
    real = policy.prefill
    policy.prefill = lambda layer, q, k, v: (seen.__setitem__(layer, (q, k)), real(layer, q, k, v))[1]
    Recorder(policy, args, T=30)
    T, candidates = 30, list(range(2, 26))
    for layer, h in [(0, 0), (0, 1), (1, 1)]:       # the first layers of the blocks
        q, k = seen[layer]
        obs = column_scores(q, k, torch.arange(T)[None], 3)[0, h]
        within = torch.zeros(T, dtype=torch.bool)
        within[candidates] = True
        pooled = pool1d(obs[None], 3, "max", within[None])[0]
        top = sorted(sorted(candidates, key=lambda j: -float(pooled[j]))[:6])
        for member in next(blk for blk in head_blocks[h] if blk[0] == layer):
            kept = sorted(p for p in policy.kept_positions(member)[0, h].tolist() if p >= 0)
            assert kept == [0, 1] + top + [26, 27, 28, 29], (layer, h, member)
    assert [len(h) for h in policy.kept_positions(1)[0].tolist()] == [12 + 34, 12 + 34]   # ring + distant store


def test_snapkv_budget_covering_the_prompt_equals_plain_pod(tmp_path):
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([30, 30], seed=4)
    follow = torch.randint(0, 128, (2, 8))
    outs = []
    for args in ("n_sink=2,n_recent=5,sim_threshold=0.0", "n_sink=2,n_recent=5,sim_threshold=0.0,budget=40"):
        policy = make_policy("pod", args)
        with torch.no_grad():
            model.setup_caches(2, 40, policy)
            logits = [run_prefill(model, tokens, pos)]
            logits += [run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s) for s in range(8)]
        outs.append(torch.stack(logits, 1))
        assert policy.describe()["blocks_per_head"] == [1, 1]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_calibration_script_and_on_prompt_calibration_agree_and_auto_reads_the_file(tmp_path):
    """cache/calibration.py's statistic (scripts/calibrate_pod.py's) on one sequence equals what blocks=prompt computes on
    the same prompt; the file it writes next to a checkpoint is what blocks=auto groups."""
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    sim = calibrate_pod(model, [ids[0].tolist()], queries=8)
    assert sim.shape == (2, 2, 2) and torch.allclose(sim, sim.transpose(1, 2))
    policy = make_policy("pod", "n_sink=2,n_recent=5,blocks=prompt,cal_queries=8")
    with torch.no_grad():
        model.setup_caches(1, 44, policy)
        run_prefill(model, ids, torch.arange(40)[None])
    torch.testing.assert_close(policy.similarity.float(), sim, atol=1e-6, rtol=1e-6)
    assert policy.describe()["blocks_source"] == "prompt"
    write_pod_file(pod_path(tmp_path), sim, {"samples": 1})
    assert pod_path("x/m.Q4_1.gguf").name == "m.Q4_1.pod_calibration.json"
    model.args.checkpoint = str(tmp_path)
    split = float(sim[0, 1, 0]) + 1e-3                     # just above head 0's similarity: two blocks
    policy = model.setup_caches(1, 44, make_policy("pod", f"sim_threshold={split}"))
    assert policy.describe()["blocks_source"] == str(pod_path(tmp_path))
    assert policy.head_blocks[0] == [[0], [1]]
    assert policy.head_blocks[1] == ([[0, 1]] if float(sim[1, 1, 0]) >= split else [[0], [1]])


@pytest.mark.slow
def test_compiled_decode_matches_eager_without_recompiles(tmp_path):
    from torch._dynamo.utils import counters
    _, model = tiny_hf_model("tied_gqa3", tmp_path)
    tokens, pos = left_padded([30, 21])
    follow = torch.randint(0, 128, (2, 12))
    step = torch.compile(decode_step, dynamic=True)
    outs = {}
    for mode, decode in (("eager", decode_step), ("compiled", step)):
        with torch.no_grad():
            model.setup_caches(2, 48, make_policy("pod", "n_sink=2,n_recent=5,sim_threshold=0,tau=0.9"))
            run_prefill(model, tokens, pos)
            logits = []
            for s in range(12):
                if s == 4:
                    graphs = counters["stats"]["unique_graphs"]
                logits.append(run_decode(model, follow[:, s:s + 1], pos[:, -1:] + 1 + s, s, decode))
        outs[mode] = torch.stack(logits)
    assert counters["stats"]["unique_graphs"] == graphs, "decode recompiled as tokens moved to the distant store"
    torch.testing.assert_close(outs["compiled"], outs["eager"], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- the real model

def test_real_model_every_layer_its_own_block_equals_full(engine_dir, essay_text):
    model, tok = engine_dir
    ids = torch.tensor([tok.encode(essay_text)[:400]])
    pos = torch.arange(400)[None]
    outs = []
    for policy in (None, make_policy("pod", "n_sink=4,n_recent=64,blocks=layers")):
        with torch.inference_mode():
            model.setup_caches(1, 406, policy)
            logits = [run_prefill(model, ids[:, :394], pos[:, :394])]
            logits += [run_decode(model, ids[:, 394 + s:395 + s], pos[:, 394 + s:395 + s], s) for s in range(5)]
        outs.append(torch.stack(logits, 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_real_model_kv_bytes_saving_matches_the_blocks(engine_dir, essay_text):
    model, tok = engine_dir
    ids = torch.tensor([tok.encode(essay_text)[:600]])
    pos = torch.arange(600)[None]
    with torch.inference_mode():
        full = model.setup_caches(1, 640, None)
        run_prefill(model, ids, pos)
        policy = model.setup_caches(1, 640, make_policy("pod", "n_sink=16,n_recent=112,blocks=prompt,sim_threshold=0.5"))
        run_prefill(model, ids, pos)
    saved = 1 - policy.kv_bytes()["allocated"] / full.kv_bytes()["allocated"]
    assert saved == pytest.approx(key_saving(policy.head_blocks, 30, 640, 128), abs=1e-12)
    assert 0 < saved < 0.5 and policy.describe()["blocks_per_head"] != [30, 30, 30]
