"""StreamingLLM on the shared eviction mechanics (cache/base.py): hand-checked kept sets,
flat memory during decode, equivalence with the full cache when nothing is evicted."""
import pytest
import torch

import engine
from cache import PolicyError, make_policy
from tests.helpers import kept, left_padded, tiny_hf_model


def test_prefill_keeps_sinks_and_recent_window_per_sequence(tmp_path):
    _, model = tiny_hf_model("llama31", tmp_path)
    policy = make_policy("streaming", "budget=8,n_sink=2")
    tokens, pos = left_padded([20, 13, 5])
    with torch.no_grad():
        model.setup_caches(3, 64, policy)
        model(tokens, pos)
    for layer in range(model.args.n_layers):
        rows = kept(policy, layer)
        assert all(h == [0, 1] + list(range(14, 20)) for h in rows[0])
        assert all(h == [0, 1] + list(range(7, 13)) for h in rows[1])
        assert all(h == [0, 1, 2, 3, 4] for h in rows[2])          # shorter than the budget: all kept


def test_decode_evicts_oldest_non_sink_and_stays_flat(tmp_path):
    _, model = tiny_hf_model("llama31", tmp_path)
    policy = make_policy("streaming", "budget=8,n_sink=2")
    tokens, pos = left_padded([20, 5])
    with torch.no_grad():
        model.setup_caches(2, 64, policy)
        model(tokens, pos)
        allocated = policy.kv_bytes()["allocated"]
        last = pos[:, -1:]
        for step in range(1, 11):
            model(torch.randint(0, 128, (2, 1)), last + step, decode=True)
            rows = kept(policy)
            assert all(h == [0, 1] + list(range(20 + step - 6, 20 + step)) for h in rows[0])
            n1 = 5 + step                                         # row 1 fills its empty slots first
            expect = list(range(n1)) if n1 <= 8 else [0, 1] + list(range(n1 - 6, n1))
            assert all(h == expect for h in rows[1]), (step, rows[1])
            assert policy.kv_bytes()["allocated"] == allocated
            assert policy.kept_positions(0).shape[-1] == 8


@pytest.mark.parametrize("kind", ["llama31", "mistral"])
def test_budget_covering_everything_equals_full_cache(kind, tmp_path):
    """No eviction -> the gather/scatter storage and per-head masks must reproduce the full cache."""
    _, model = tiny_hf_model(kind, tmp_path)
    tokens, pos = left_padded([17, 9, 12], seed=3)
    follow = torch.randint(0, 128, (3, 8))
    outs = []
    for policy in (None, make_policy("streaming", "budget=64,n_sink=4")):
        with torch.no_grad():
            model.setup_caches(3, 64, policy)
            logits = [model(tokens, pos)[:, -1:]]
            logits += [model(follow[:, s:s + 1], pos[:, -1:] + 1 + s, decode=True) for s in range(8)]
        outs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_first_token_equals_full_and_memory_flat_on_real_model(engine_dir, essay_text):
    model, tok = engine_dir
    ids = tok.encode(essay_text)[:600]
    full = engine.generate(model, tok, [ids], max_new_tokens=12)
    stream = engine.generate(model, tok, [ids], max_new_tokens=12, policy=make_policy("streaming", "budget=64"))
    assert stream.tokens[0][0] == full.tokens[0][0]                  # prefill attention is full
    assert stream.stats["kv_bytes_allocated"] * 9 < full.stats["kv_bytes_allocated"]


def test_bad_streaming_arguments():
    with pytest.raises(PolicyError, match=r"budget \(4\) must exceed n_sink \(4\)"):
        make_policy("streaming", "budget=4")
    with pytest.raises(PolicyError, match="not a valid int"):
        make_policy("streaming", "budget=lots")
