"""eval/similarity.py: HShare's Figure 1 statistics, on hand-made sets and on the real model."""
import json

import torch

from eval import similarity


def members(sets, size=8):
    """Nested lists of token-id sets -> membership tensor [..., size]."""
    out = torch.zeros(len(sets), len(sets[0]), len(sets[0][0]), size, dtype=torch.bool)
    for i, layer in enumerate(sets):
        for h, head in enumerate(layer):
            for q, ids in enumerate(head):
                out[i, h, q, list(ids)] = True
    return out


def test_similarity_matrices_follow_equation_3_on_hand_made_sets():
    # 2 layers x 2 heads x 2 queries, sets of size 3 (one of size 2: max() in the denominator)
    sets = members([[[{0, 1, 2}, {0, 1, 3}], [{4, 5, 6}, {4, 5, 6}]],
                    [[{0, 1, 7}, {0, 1}], [{4, 5, 6}, {5, 6, 7}]]])
    m = similarity.similarity_matrices(sets)
    # layer 1 vs 0: head 0: q0 2/3, q1 2/3 (|{0,1}| / max(2, 3)); head 1: q0 1, q1 2/3
    torch.testing.assert_close(m["layer"][1, 0], torch.tensor((2 / 3 + 2 / 3 + 1 + 2 / 3) / 4))
    torch.testing.assert_close(m["layer"], m["layer"].T)
    assert torch.allclose(torch.diagonal(m["layer"]), torch.ones(2))
    # heads of layer 0 share nothing
    assert m["head"][0, 0, 1] == 0 and m["head"][0, 1, 1] == 1
    # adjacent queries: layer 0 head 0: {0,1,2} vs {0,1,3} = 2/3; layer 1 head 1: 2/3
    torch.testing.assert_close(m["adjacent"], torch.tensor([[2 / 3, 1.0], [2 / 3, 2 / 3]]))
    s = similarity.summary(m)
    assert s["adjacent_layers"] == round(float(m["layer"][1, 0]), 4) and s["head_pairs"] is not None


def test_critical_sets_are_causal_top_logits_and_can_skip_sinks_and_recent():
    torch.manual_seed(0)
    k = torch.randn(1, 10, 4)
    q = torch.randn(2, 1, 4)                                    # 2 query heads on one KV head
    pos = torch.arange(10)
    sets = similarity.critical_sets(q, k, torch.tensor([6]), pos, 3)
    logits = (q[:, 0] @ k[0].T)[:, :7]                          # keys 0..6 are visible at position 6
    for h in range(2):
        assert set(sets[h, 0].nonzero().flatten().tolist()) == set(logits[h].topk(3).indices.tolist())
    middle = similarity.critical_sets(q, k, torch.tensor([6]), pos, 10, exclude_first=2, exclude_last=2)
    assert set(middle[0, 0].nonzero().flatten().tolist()) == {2, 3, 4}   # all that is left: min(10, 3)


def test_real_model_analysis_writes_matrices_and_heatmap(default_dir, tmp_path, capsys):
    assert similarity.main(["--checkpoint", str(default_dir), "--length", "300", "--queries", "4",
                            "--decode-steps", "3", "--n-critical", "32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "similarity.json").read_text())
    for phase in ("prefill", "decode"):
        layer = torch.tensor(result[phase]["layer"])
        assert layer.shape == (30, 30) and torch.allclose(torch.diagonal(layer), torch.ones(30))
        assert torch.tensor(result[phase]["head"]).shape == (30, 9, 9)
        assert 0 < result[phase]["summary"]["adjacent_queries"] < 1
    assert (tmp_path / "similarity.png").stat().st_size > 0
    assert "adjacent_layers" in capsys.readouterr().out
    assert similarity.main(["--checkpoint", str(default_dir), "--length", "100", "--queries", "200",
                            "--out", str(tmp_path)]) == 2
