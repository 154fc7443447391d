"""eval/: the needle-in-a-haystack grid and decode-time perplexity on the real default model,
with exact oracles where there is one (a single full forward pass for perplexity)."""
import json
import math
import subprocess
import sys

import pytest
import torch

from cache import make_policy
from eval import common, needle, perplexity
from tests.conftest import ESSAYS, ROOT


@pytest.fixture(scope="module")
def loaded(engine_dir):
    model, tokenizer = engine_dir
    return common.Loaded(model, tokenizer, model.output.weight.device)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    """The tiny random model of tests/conftest.py (the default model's tokenizer), for tests of the
    eval plumbing that do not depend on what the real model answers."""
    import engine
    model, tokenizer = engine.load_model(tiny_dir)
    return common.Loaded(model, tokenizer, model.output.weight.device)


@pytest.fixture(scope="module")
def essays() -> str:
    return common.read_text_folder(ESSAYS)


def run_main(module, capsys, *argv):
    """module.main in-process -> (exit code, stdout, stderr)."""
    try:
        code = module.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- needle

def test_haystack_builder_exact_length_needle_at_sentence_boundary(loaded):
    """Exact length: the prompt is assembled from separately tokenized pieces, so its length is
    exact by construction (decoding and re-tokenizing it may differ by a token at the seams)."""
    tok = loaded.tokenizer
    text = " ".join(f"Sentence number {i} is about the colour of tree {i % 7}." for i in range(400))
    hay = needle.Haystack.from_text(tok, text)
    sentence = len(tok.encode(" Sentence number 123 is about the colour of tree 4.", add_special_tokens=False))
    for length, position in ((200, "after"), (1000, "after"), (1000, "both")):
        for depth in (0.0, 0.25, 0.5, 0.9, 1.0):
            p = needle.build_prompt(tok, hay, "The secret code is purple.", "What is the secret code?", length, depth,
                                    question_position=position)
            assert len(p.ids) == length
            assert tok.decode(p.ids).count("What is the secret code?") == (2 if position == "both" else 1)
            assert abs(p.cut - depth * p.n_haystack) <= sentence              # the nearest sentence end
            prompt = tok.decode(p.ids)
            assert prompt.count("The secret code is purple.") == 1
            assert tok.decode(p.ids[p.needle_start:]).lstrip().startswith("The secret code is purple.")
            assert p.cut == 0 or tok.decode(p.ids[:p.needle_start]).endswith(".")
            assert prompt.startswith("<|im_start|>") and prompt.endswith("What is the secret code?<|im_end|>\n"
                                                                         "<|im_start|>assistant\n")
    short = needle.Haystack.from_text(tok, "One sentence only.", min_tokens=300)      # repeated to fit
    assert len(short.ids) >= 300 and len(needle.build_prompt(tok, short, "N.", "Q?", 300, 0.5).ids) == 300
    with pytest.raises(common.UsageError, match="too short"):
        needle.build_prompt(tok, hay, "N.", "Q?", 20, 0.5)


def test_hit_needs_all_keywords_case_insensitive():
    keys = needle.KEYWORDS.split(",")
    assert needle.is_hit("Eat a SANDWICH and sit in dolores park.", keys)
    assert not needle.is_hit("Eat a sandwich.", keys)


def needle_grid(loaded, essays, policy_name, policy_args, length, depths):
    hay = needle.Haystack.from_text(loaded.tokenizer, essays, length)
    answers = []
    for d in depths:
        p = needle.build_prompt(loaded.tokenizer, hay, needle.NEEDLE, needle.QUESTION, length, d)
        answers.append(needle.run_cell(loaded, make_policy(policy_name, policy_args), p.ids, 24))
    return [needle.is_hit(a, needle.KEYWORDS.split(",")) for a in answers], answers


def test_needle_full_cache_finds_it_at_every_depth(loaded, essays):
    hits, answers = needle_grid(loaded, essays, "full", "", 1000, (0.1, 0.5, 0.9))
    assert hits == [True, True, True], answers


def test_needle_streaming_finds_it_only_inside_its_window(loaded, essays):
    """budget=256 keeps 4 sinks + the last 252 tokens: the needle at depth 0.9 (about token 880 of
    1000) is kept and found, the one in the middle is evicted at prefill and cannot be recalled."""
    hits, answers = needle_grid(loaded, essays, "streaming", "budget=256", 1000, (0.5, 0.9))
    assert hits == [False, True], answers


# --------------------------------------------------------------------------- perplexity

CONTEXT, EVAL = 1100, 40     # prefill in two chunks of the full cache (engine chunks at 1024)


@pytest.fixture(scope="module")
def window(loaded, essays):
    return torch.tensor(loaded.tokenizer.encode(essays, add_special_tokens=False)[:CONTEXT + EVAL])


@pytest.fixture(scope="module")
def full_nll(loaded, window):
    return perplexity.window_nll(loaded.model, window, CONTEXT)


def test_decode_step_nll_equals_one_full_forward_pass(loaded, window, full_nll):
    model, W = loaded.model, window.shape[0]
    model.setup_caches(1, W)
    with torch.inference_mode():
        logits = model(window[None], torch.arange(W))[0, CONTEXT - 1:-1].float()
    oracle = torch.nn.functional.cross_entropy(logits, window[CONTEXT:], reduction="none")
    assert full_nll.shape == (EVAL,)
    torch.testing.assert_close(full_nll, oracle, rtol=0, atol=1e-4)


def test_streaming_with_budget_beyond_the_window_equals_full(loaded, window, full_nll):
    nll = perplexity.window_nll(loaded.model, window, CONTEXT, make_policy("streaming", f"budget={CONTEXT + EVAL}"))
    torch.testing.assert_close(nll, full_nll, rtol=0, atol=1e-4)
    # a 256-token window: the first prediction comes from full-attention prefill, the later ones
    # from the evicted cache
    small = perplexity.window_nll(loaded.model, window, CONTEXT, make_policy("streaming", "budget=256"))
    torch.testing.assert_close(small[0], full_nll[0], rtol=0, atol=1e-4)
    assert (small[1:] - full_nll[1:]).abs().max() > 1e-2


# --------------------------------------------------------------------------- CLI: JSON and errors

def test_needle_json(default_dir, essays, tmp_path, capsys):
    out = tmp_path / "needle.json"
    code, stdout, err = run_main(needle, capsys, "--checkpoint", default_dir, "--lengths", "400", "--depths", "0.5",
                                 "--max-new-tokens", "24", "--policy", "streaming", "--policy-args", "budget=128",
                                 "--json", out)
    assert code == 0, err
    assert "[1/1] length 400 depth 0.5" in err and " s total)" in err
    assert "length \\ depth" in stdout and "accuracy" in stdout
    r = json.loads(out.read_text())
    assert {"policy", "policy_args", "kv_bits", "accuracy", "results", "describe", "kv_bytes"} <= set(r)
    assert (r["policy"], r["policy_args"], r["kv_bits"]) == ("streaming", "budget=128", 16)
    assert r["describe"]["budget"] == 128 and r["kv_bytes"]["allocated"] > 0
    (cell,) = r["results"]
    assert {"length", "depth", "hit", "answer"} <= set(cell) and cell["prompt_tokens"] == 400
    assert r["accuracy"] == float(cell["hit"])


def test_perplexity_json(default_dir, essays, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    code, stdout, err = run_main(perplexity, capsys, "--checkpoint", default_dir, "--context-length", "64",
                                 "--eval-tokens", "8", "--samples", "2", "--json", out)
    assert code == 0, err
    assert "[2/2] sample 1" in err and "mean" in stdout
    r = json.loads(out.read_text())
    assert {"policy", "policy_args", "kv_bits", "mean_nll", "perplexity", "results", "describe", "kv_bytes"} <= set(r)
    assert [s["start"] for s in r["results"]] == [0, 72]                      # non-overlapping windows
    assert r["mean_nll"] == pytest.approx(sum(s["nll"] for s in r["results"]) / 2)
    assert r["perplexity"] == pytest.approx(math.exp(r["mean_nll"]))
    assert r["kv_bytes"]["live"] == 71 * 30 * 2 * 3 * 64 * 4                  # 71 tokens cached, fp32 K and V


@pytest.mark.parametrize("module,argv,message", [
    (needle, ["--checkpoint", "{tmp}/nope"], "does not exist"),
    (needle, ["--haystack", "{tmp}/nope"], "does not exist"),
    (needle, ["--haystack", "{tmp}"], "no non-empty .txt"),
    (needle, ["--policy", "nope"], "unknown policy 'nope'"),
    (needle, ["--policy", "streaming", "--policy-args", "bogus=1"], "has no parameter(s) bogus"),
    (needle, ["--kv-bits", "4", "--policy", "pod"], "--kv-bits 4: policy 'pod' has no KIVI storage"),
    (needle, ["--depths", "0.5,2"], "--depths must lie in [0, 1]"),
    (needle, ["--lengths", "9000"], "exceeds the model's context length 8192"),
    (perplexity, ["--kv-bits", "2", "--kv-group-size", "48", "--kv-residual", "48"],
     "head_dim 64 is not a multiple of --kv-group-size 48"),
    (perplexity, ["--text", "{tmp}/nope.txt"], "cannot read --text"),
    (perplexity, ["--text", "{tmp}/empty.txt"], "is empty"),
    (perplexity, ["--context-length", "8000", "--eval-tokens", "500"], "exceeds the model's context length"),
])
def test_bad_input_is_one_line_exit_2(module, argv, message, default_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = run_main(module, capsys, "--checkpoint", default_dir, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_runs_as_a_module(tmp_path):
    p = subprocess.run([sys.executable, "-m", "eval.perplexity", "--kv-bits", "4", "--kv-residual", "7"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: --kv-residual 7") and "Traceback" not in p.stderr
