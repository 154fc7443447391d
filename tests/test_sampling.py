"""sample: greedy, temperature, top-k, top-p, seeding — checked against the distribution."""
import torch

from runtime.steps import sample


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(sample(logits), logits.argmax(-1))


def test_samples_follow_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(40000, 1)
    g = torch.Generator().manual_seed(0)
    draws = sample(logits, temperature=1.0, generator=g)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.01, rtol=0)
    hot = torch.bincount(sample(logits, temperature=2.0, generator=g), minlength=4).float() / len(draws)
    torch.testing.assert_close(hot, (logits[0] / 2).softmax(-1), atol=0.01, rtol=0)


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -2.0]).repeat(5000, 1)
    g = torch.Generator().manual_seed(1)
    assert set(sample(logits, 1.0, top_k=2, generator=g).tolist()) == {0, 1}
    # probs ~ [.505, .457, .025, .009, .003]: the smallest set whose mass reaches top_p is kept
    assert set(sample(logits, 1.0, top_p=0.9, generator=g).tolist()) == {0, 1}
    assert set(sample(logits, 1.0, top_p=0.97, generator=g).tolist()) == {0, 1, 2}
    assert set(sample(logits, 1.0, top_p=1e-6, generator=g).tolist()) == {0}


def test_seed_reproducible():
    logits = torch.randn(8, 1000)
    a = sample(logits, 1.0, generator=torch.Generator().manual_seed(7))
    b = sample(logits, 1.0, generator=torch.Generator().manual_seed(7))
    c = sample(logits, 1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
