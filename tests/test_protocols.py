"""The two protocols of the question tasks (aware: the prompt with its question compressed; agnostic:
the context alone, the question appended whole), and the generated RULER-format tasks."""
import json

import pytest

from cache import make_policy
from eval import longbench, measure, metrics, needle, ruler, ruler_synth, suite
from tests import test_eval

loaded, tiny_loaded, essays, run_main = test_eval.loaded, test_eval.tiny_loaded, test_eval.essays, test_eval.run_main


def spec(text):
    return lambda: make_policy(text)


# --------------------------------------------------------------------------- protocols on the default model

def test_needle_under_both_protocols_on_the_default_model(loaded, essays):
    """The full cache answers alike in both protocols (the same tokens, nothing dropped); snapkv at a small
    budget runs in both, and every row records its protocol."""
    full = {p: needle.evaluate(loaded, spec("full"), essays, [600], [0.5], protocol=p) for p in measure.PROTOCOLS}
    assert full["aware"]["results"][0]["answer"] == full["agnostic"]["results"][0]["answer"]
    assert full["aware"]["score"] == 100.0
    for p in measure.PROTOCOLS:
        r = needle.evaluate(loaded, spec("snapkv:budget=64"), essays, [600], [0.5], protocol=p)
        assert r["results"][0]["protocol"] == p and r["describe"]["budget"] == 64
        assert r["usage"]["prompt_tokens"] == 600


def test_agnostic_keeps_the_question_whole_where_aware_compresses_it(loaded, essays):
    """snapkv:budget=64 on a 600-token needle prompt: agnostic keeps the context's 64 per head plus every
    question token; aware keeps 64 of the whole prompt."""
    hay = needle.Haystack.from_text(loaded.tokenizer, essays, 600)
    p = needle.build_prompt(loaded.tokenizer, hay, needle.NEEDLE, needle.QUESTION, 600, 0.5)
    _, policy = measure.answer(loaded, spec("snapkv:budget=64"), p.ids, p.question_start, 1, "agnostic")
    question = set(range(p.question_start, 600))
    for head in policy.kept_positions(0)[0].tolist():
        kept = {x for x in head if x >= 0}
        assert question <= kept and len(kept - question) == 64
    _, policy = measure.answer(loaded, spec("snapkv:budget=64"), p.ids, p.question_start, 1, "aware")
    assert all(len({x for x in head if 0 <= x < 600}) == 64 for head in policy.kept_positions(0)[0].tolist())


@pytest.mark.parametrize("policy", ["knorm:ratio=0.5", "tova:ratio=0.75", "h2o:budget=48"])
def test_the_evals_agnostic_protocol_holds_the_question_whole(tiny_loaded, essays, policy):
    """The eval's agnostic path (measure.answer, the needle's prompt split where its question starts) on the tiny
    model: when the first answer token is sampled every question position is held in every layer and KV head."""
    tok = tiny_loaded.tokenizer
    hay = needle.Haystack.from_text(tok, essays, 400)
    p = needle.build_prompt(tok, hay, needle.NEEDLE, needle.QUESTION, 400, 0.5)
    _, cache = measure.answer(tiny_loaded, spec(policy), p.ids, p.question_start, 1, "agnostic")
    question = set(range(p.question_start, 400))
    assert len(question) > 16
    for layer in range(tiny_loaded.model.args.n_layers):
        assert all(question <= set(head) for head in cache.kept_positions(layer)[0].tolist()), layer


def test_needle_cli_records_the_protocol(default_dir, tmp_path, capsys):
    out = tmp_path / "n.json"
    code, _, err = run_main(needle, capsys, "--checkpoint", default_dir, "--lengths", "400", "--depths", "0.5",
                            "--max-new-tokens", "8", "--protocol", "agnostic", "--json", out)
    assert code == 0, err
    r = json.loads(out.read_text())
    assert r["protocol"] == "agnostic" and r["results"][0]["protocol"] == "agnostic"
    code, _, err = run_main(needle, capsys, "--checkpoint", default_dir, "--protocol", "agnostic",
                            "--question-position", "both")
    assert code == 2 and "needs --question-position after" in err


def test_longbench_agnostic_split_keeps_the_question_whole(loaded):
    tok = loaded.tokenizer
    task = longbench.Task.named("hotpotqa")
    row = {"input": "Who QMARK?", "answers": ["x"], "context": "HEAD " + "filler words. " * 600 + " TAIL"}
    ids, cut, split = longbench.build_ids(tok, task, row, 300, protocol="agnostic")
    assert len(ids) == 300 and cut > 0
    assert "Who QMARK?" in tok.decode(ids[split:]) and "QMARK" not in tok.decode(ids[:split])
    assert tok.decode(ids[:split]).rstrip().endswith("TAIL")
    with pytest.raises(longbench.UsageError, match="before the context"):
        longbench.context_split(longbench.Task("t", "{input} then {context}", 8, "qa_f1", True, False))


# --------------------------------------------------------------------------- the suite

def test_suite_runs_question_tasks_under_both_protocols(monkeypatch, tiny_loaded, tmp_path, capsys):
    monkeypatch.setattr(suite.common, "load", lambda args: tiny_loaded)
    out = tmp_path / "run"
    code, _, err = run_main(suite, capsys, "--policies", "full;snapkv:budget=32", "--tasks",
                            "needle,perplexity,ruler_synth:niah_single_1", "--protocol", "both", "--lengths", "300",
                            "--depths", "0.5", "--context-length", "48", "--eval-tokens", "4", "--ruler-length",
                            "400", "--ruler-samples", "1", "--no-plot", "--quiet", "--out", out)
    assert code == 0, err
    r = json.loads((out / "results.json").read_text())
    cells = {(c["row"], c["task"]): c for c in r["cells"]}
    assert r["rows"] == ["full", "full agnostic", "snapkv:budget=32", "snapkv:budget=32 agnostic"]
    assert len(cells) == 10 and all(c["status"] == "ok" for c in cells.values())
    assert cells["full agnostic", "needle"]["protocol"] == "agnostic"
    assert cells["full", "perplexity"]["protocol"] is None and ("full agnostic", "perplexity") not in cells
    assert cells["snapkv:budget=32 agnostic", "ruler_synth:niah_single_1"]["results"][0]["protocol"] == "agnostic"
    assert "| `snapkv:budget=32 agnostic` |" in (out / "results.md").read_text()
    with pytest.raises(suite.UsageError, match="ruler_synth:NAME"):
        suite.parse_tasks("ruler_synth:nope")


# --------------------------------------------------------------------------- RULER-format generator

@pytest.fixture(scope="module")
def source():
    return ruler_synth.Source.read()


@pytest.mark.parametrize("name", list(ruler_synth.TASKS))
def test_generator_is_seeded_fits_and_hides_the_answers(tiny_loaded, source, name):
    tok, n = tiny_loaded.tokenizer, 4096 if name == "cwe" else 1024     # cwe: its 300 frequent entries alone ~1800
    rows = ruler_synth.generate(tok, name, n, 2, seed=3, source=source)
    assert rows == ruler_synth.generate(tok, name, n, 2, seed=3, source=source)          # deterministic
    assert rows != ruler_synth.generate(tok, name, n, 2, seed=4, source=source)
    new = ruler_synth.template(name)[2]
    for row in rows:
        ids, split = ruler.row_ids(tok, row, "agnostic")
        assert row["input"] == row["context"] + row["question"] and len(ids) == row["length"]
        assert n - new - 100 < len(ids) <= n - new                       # the haystack grown to the limit
        assert all(o in row["context"] for o in row["outputs"]) and row["outputs"]
        assert row["question"].endswith("<|im_start|>assistant\n") and split < len(ids)
    if name == "cwe":
        listed = rows[0]["context"].rsplit("\n", 1)[1].split()
        assert all(listed.count(w) == 30 for w in rows[0]["outputs"])
    if name == "niah_multiquery":
        assert len(rows[0]["outputs"]) == 4 and ", and " in rows[0]["question"]


def test_ruler_metric_on_hand_cases():
    """RULER's string_match_all: the share of expected strings found, case-insensitive; after RULER's cleaning."""
    assert metrics.string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert metrics.string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert metrics.string_match_all("ABCDE, FGHIJ", ["abcde", "fghij", "klmno", "pqrst"]) == 0.5
    assert metrics.string_match_all("", ["x"]) == 0.0
    assert metrics.ruler_postprocess("  a\x00b\tc ") == "a\nb\nc"


def test_generated_rows_score_perfectly_when_answered_with_the_outputs(tiny_loaded, source, monkeypatch):
    rows = ruler_synth.generate(tiny_loaded.tokenizer, "niah_multivalue", 600, 2, source=source)
    monkeypatch.setattr(ruler.measure, "answer", lambda loaded, new, ids, split, n, protocol, usage, compile:
                        (" and ".join(reversed(rows[0]["outputs"])), make_policy("full")))
    r = ruler.evaluate(tiny_loaded, spec("full"), rows[:1], "all", 8, "niah_multivalue", protocol="agnostic")
    assert r["score"] == 100.0 and r["results"][0]["protocol"] == "agnostic"


def test_ruler_agnostic_needs_split_rows(tiny_loaded, tmp_path):
    with pytest.raises(ruler.UsageError, match="needs rows with `context` and `question`"):
        ruler.row_ids(tiny_loaded.tokenizer, {"input": "x", "outputs": ["y"]}, "agnostic")
    for row in ({"input": "ab", "context": "a", "outputs": ["y"]},
                {"input": "ab", "context": "a", "question": "c", "outputs": ["y"]}):
        (tmp_path / "r.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(ruler.UsageError, match="must both be given and equal `input`"):
            ruler.read_rows(tmp_path / "r.jsonl")
