"""Long runs: an append-only cache refuses a decode step past its capacity (CacheFull, never an
overwrite), a bounded policy runs on past it with finite logits, and the soak summary's flatness
checks (scripts/bench/soak.py) flag RSS drift, NaN/inf steps and a falling tokens/s."""
import sys

import pytest
import torch

from cache import make_policy
from model import ModelArgs, Transformer
from runtime.steps import CacheFull, run_decode, run_prefill
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from bench.soak import soak_summary  # noqa: E402

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                 max_position_embeddings=64)


def decode_until_refused(policy, capacity: int, steps: int, beyond_context: bool = False) -> list:
    torch.manual_seed(0)
    model = Transformer(ARGS).eval()
    prompt = torch.randint(0, 64, (1, 8))
    logits = []
    with torch.inference_mode():
        model.setup_caches(1, capacity, policy, beyond_context=beyond_context)
        token = run_prefill(model, prompt, torch.arange(8)[None]).argmax(-1, keepdim=True)
        for i in range(steps):
            out = run_decode(model, token, torch.tensor([[8 + i]]), i)
            logits.append(out)
            token = out.argmax(-1, keepdim=True)
    return logits


def test_full_cache_refuses_past_capacity():
    with pytest.raises(CacheFull, match=r"KV cache full: decode step 4 needs slot 13 .*'full'.* "
                                        r"max_seq_length 12.*refusing to overwrite"):
        decode_until_refused(make_policy("full"), 12, 10)


def test_bounded_policy_runs_past_its_budget():
    logits = decode_until_refused(make_policy("streaming:budget=8,n_sink=2"), 8 + 100, 100, beyond_context=True)
    assert len(logits) == 100 and all(torch.isfinite(x).all() for x in logits)


def windows(rss, speed, bad=0):
    return [{"step": 500 * (i + 1), "rss_bytes": r, "tokens_per_s": s, "nonfinite_steps": bad if i == 2 else 0}
            for i, (r, s) in enumerate(zip(rss, speed))]


def test_soak_summary_flags():
    flat = soak_summary(windows([1000, 1010, 995, 1001, 1000], [10, 10, 11, 10, 10]))
    assert flat["soak_failures"] == [] and flat["rss_max_drift"] == pytest.approx(0.01)
    bad = soak_summary(windows([1000, 1030, 1060, 1090, 1100], [10, 10, 10, 6, 6], bad=3))
    assert [f.split()[0] for f in bad["soak_failures"]] == ["RSS", "3", "tokens/s"]
