"""eval/: LongBench, RULER, passkey, agreement and the suite, on the real default model at tiny
sizes (short prompts, one row), plus the suite's resume/interrupt behaviour and its report (on the
tiny random model of tests/conftest.py: those tests check the suite's bookkeeping, not scores)."""
import csv
import json

import pytest
import torch

from cache import make_policy
from eval import agreement, common, longbench, measure, passkey, prompts, ruler, suite, suite_cells, suite_report
from tests.conftest import MULTI_NEWS
from tests import test_eval

loaded, tiny_loaded, essays, run_main = test_eval.loaded, test_eval.tiny_loaded, test_eval.essays, test_eval.run_main
# (shared fixtures and helper)


@pytest.fixture(scope="module")
def multi_news():
    return MULTI_NEWS


# --------------------------------------------------------------------------- LongBench

def test_longbench_prompt_is_middle_truncated_to_the_budget_with_the_template(loaded, multi_news):
    tok = loaded.tokenizer
    rows = longbench.read_rows(multi_news, limit=20)
    task = longbench.task_for(multi_news, rows)
    assert task.name == "multi_news" and task.chat and task.max_new_tokens == 512 and task.metric == "rouge_l"
    row = {"input": "", "answers": ["x"], "context": "HEADMARK " + "filler words. NEWLINE_CHAR " * 600 + " TAILMARK"}
    ids, cut, _ = longbench.build_ids(tok, task, row, 300)
    assert len(ids) == 300 and cut > 0
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("Summary:<|im_end|>\n<|im_start|>assistant\n")
    assert "You are given several news passages." in text and "HEADMARK" in text and "TAILMARK" in text
    assert "NEWLINE_CHAR" not in text
    assert "NEWLINE_CHAR" in tok.decode(longbench.build_ids(tok, task, row, 300, keep_newline_char=True)[0])
    # the body is exactly the head and tail of the untruncated body
    prefix, suffix = prompts.wrap(tok, prompts.SENTINEL, True)
    body = tok.encode(task.prompt.format(context=row["context"].replace("NEWLINE_CHAR", "\n"), input=""),
                      add_special_tokens=False)
    assert ids == prefix + prompts.truncate_middle(body, 300 - len(prefix) - len(suffix)) + suffix
    # real rows: never longer than the budget
    for r in rows[:5]:
        assert len(longbench.build_ids(tok, task, r, 2048)[0]) <= 2048
    # no chat template where LongBench applies none
    trec = longbench.Task.named("trec")
    ids, _, _ = longbench.build_ids(tok, trec, {"context": "Q: a?\nType: Entity", "input": "Q: b?", "answers": ["x"]}, 64)
    assert tok.decode(ids).startswith("Please determine the type of the question below.")


@pytest.mark.parametrize("lines,message", [
    (['{"input": "", "context": "c"}'], "has no field(s) answers"),
    (['not json'], "line 1 is not JSON"),
    (['{"input": "", "context": "c", "answers": []}'], "`answers` must be a non-empty list"),
])
def test_longbench_bad_rows_are_one_line_exit_2(lines, message, default_dir, tmp_path, capsys):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = run_main(longbench, capsys, "--checkpoint", default_dir, "--data", path)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_longbench_cli_on_multi_news(default_dir, multi_news, tmp_path, capsys):
    out = tmp_path / "lb.json"
    code, stdout, err = run_main(longbench, capsys, "--checkpoint", default_dir, "--data", "multi_news", "--data-dir",
                                 multi_news.parent, "--limit", 1, "--max-context", 256, "--max-new-tokens", 8,
                                 "--json", out)
    assert code == 0, err
    r = json.loads(out.read_text())
    assert r["task"] == "multi_news" and r["metric"] == "rouge_l" and len(r["results"]) == 1
    (row,) = r["results"]
    assert row["prompt_tokens"] == 256 and row["truncated_tokens"] > 0
    assert r["score"] == pytest.approx(100 * longbench.metrics.rouge_l(row["prediction"], json.loads(
        multi_news.read_text().splitlines()[0])["answers"][0]))
    assert r["usage"]["requests"] == 1 and r["usage"]["kv_allocated"] > 0 and "multi_news: rouge_l" in stdout
    code, _, err = run_main(longbench, capsys, "--checkpoint", default_dir, "--data", "nope", "--data-dir", tmp_path)
    assert code == 2 and "no LongBench task 'nope'" in err and "scripts/download.py longbench" in err


# --------------------------------------------------------------------------- passkey and RULER

def test_passkey_prompt_exact_length_key_at_depth(loaded):
    tok = loaded.tokenizer
    hay = passkey.filler(tok, 400)
    for depth in (0.0, 0.5, 1.0):
        p = passkey.build_prompt(tok, hay, "48213", 400, depth)
        assert len(p.ids) == 400 and abs(p.depth - depth) < 0.1
        text = tok.decode(p.ids)
        assert text.count("The pass key is 48213. Remember it. 48213 is the pass key.") == 1
        assert text.rstrip().endswith("What is the pass key?<|im_end|>\n<|im_start|>assistant")
    keys = [k for *_, k in passkey.grid([300, 400], [0.5], 2, seed=3)]
    assert keys == [k for *_, k in passkey.grid([300, 400], [0.5], 2, seed=3)] and len(set(keys)) == 4
    assert all(len(k) == 5 and k.isdigit() for k in keys)


def test_passkey_and_ruler_round_trip_on_the_model(loaded, default_dir, tmp_path, capsys):
    """Passkey prompts exported as RULER jsonl score the same under eval.ruler as under eval.passkey."""
    data = tmp_path / "passkey.jsonl"
    assert passkey.write_ruler(data, loaded.tokenizer, [200], [0.3, 0.7], 1, 0, True) == 2
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert all(len(r["outputs"]) == 1 and r["outputs"][0] in r["input"] for r in rows)
    pk = passkey.evaluate(loaded, lambda: make_policy("full"), [200], [0.3, 0.7], max_new_tokens=12)
    out = tmp_path / "rl.json"
    code, stdout, err = run_main(ruler, capsys, "--checkpoint", default_dir, "--data", data, "--max-new-tokens", 12,
                                 "--json", out)
    assert code == 0, err
    rl = json.loads(out.read_text())
    assert rl["metric"] == "string_match_all" and rl["task"] == "passkey" and "passkey: string_match_all" in stdout
    assert [r["key"] for r in pk["results"]] == [r["outputs"][0] for r in rl["results"]]
    assert [r["hit"] for r in pk["results"]] == [r["score"] == 1.0 for r in rl["results"]]
    assert pk["score"] == rl["score"] == 100.0                   # 200 tokens: the model finds both keys


@pytest.mark.parametrize("line,message", [
    ('{"input": "x"}', "has no field(s) outputs"),
    ('{"input": "x", "outputs": []}', "`outputs` must be a non-empty list"),
    ('{"input": " ", "outputs": ["a"]}', "`input` is empty"),
])
def test_ruler_bad_rows(line, message, default_dir, tmp_path, capsys):
    path = tmp_path / "niah.jsonl"
    path.write_text(line + "\n")
    code, _, err = run_main(ruler, capsys, "--checkpoint", default_dir, "--data", path)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_ruler_metric_choice_and_answer_prefix():
    assert ruler.pick_metric("auto", "qa_1") == "part" and ruler.pick_metric("auto", "niah_single_1") == "all"
    assert ruler.prompt_text({"input": "Q?", "answer_prefix": " Answer:"}) == "Q? Answer:"
    assert ruler.prompt_text({"input": "Q? Answer:", "answer_prefix": " Answer:"}) == "Q? Answer:"


# --------------------------------------------------------------------------- agreement

def test_compare_hand_cases():
    assert agreement.compare([1, 2, 3, 4], [1, 2, 3, 4]) == {"first_divergence": 4, "token_agreement": 1.0}
    assert agreement.compare([1, 9, 3, 9], [1, 2, 3, 4]) == {"first_divergence": 1, "token_agreement": 0.5}
    assert agreement.compare([9, 2], [1, 2]) == {"first_divergence": 0, "token_agreement": 0.5}


def test_proximal_forward_equals_teacher_forced_streaming(loaded, essays):
    """The band mask of ProximalCache (first n_sink + last n_recent, every layer and position) is
    what a streaming cache of budget n_sink + n_recent computes when teacher-forced after a
    prompt that fits the budget; a window covering everything is the full model."""
    ids = loaded.tokenizer.encode(essays, add_special_tokens=False)[:96]
    C, n_sink, n_recent = 40, 4, 36
    prox = agreement.last_logits(loaded.model, ids, len(ids) - C, agreement.ProximalCache(n_sink, n_recent), chunk=30)
    streamed = measure.forced_logits(loaded.model, torch.tensor(ids), C,
                                     make_policy("streaming", f"budget={n_sink + n_recent},n_sink={n_sink}"))
    # prox row i is position C + i; streamed row i predicts token C + i, i.e. is position C + i - 1
    torch.testing.assert_close(prox[:-1], streamed[1:], rtol=0, atol=5e-4)
    full = agreement.last_logits(loaded.model, ids, len(ids) - C)
    wide = agreement.last_logits(loaded.model, ids, len(ids) - C, agreement.ProximalCache(4, 10_000))
    torch.testing.assert_close(wide, full, rtol=0, atol=1e-5)
    assert (prox - full).abs().max() > 1e-2


def test_agreement_full_with_itself_and_streaming(loaded, essays):
    windows = [(0, loaded.tokenizer.encode(essays, add_special_tokens=False)[:96])]
    refs = [agreement.reference(loaded, windows[0][1], 12)]
    same = agreement.evaluate(loaded, lambda: make_policy("full"), windows, 12, refs)
    assert same["score"] == 100.0 and same["first_divergence"] == 12
    # the reference is the full cache's own greedy output: engine.generate agrees
    out = measure.engine.generate(loaded.model, loaded.tokenizer, [windows[0][1]], 12)
    assert out.tokens[0] == refs[0][:len(out.tokens[0])]
    small = agreement.evaluate(loaded, lambda: make_policy("streaming", "budget=16"), windows, 12, refs)
    assert 0 <= small["first_divergence"] < 12 and small["score"] < 100
    assert small["usage"]["kv_allocated"] < same["usage"]["kv_allocated"]


# --------------------------------------------------------------------------- suite: parsing

def test_parse_policies():
    specs = suite_cells.parse_policies("full; snapkv:budget=256,obs_window=16; hshare@a:preset=long;full:kv_bits=4;"
                                 "snapkv+hshare:budget=512,preset=short")
    assert [(s.name, s.label, s.args, s.kv_bits) for s in specs] == [
        ("full", "", "", None), ("snapkv", "", "budget=256,obs_window=16", None), ("hshare", "a", "preset=long", None),
        ("full", "", "", 4), ("snapkv+hshare", "", "budget=512,preset=short", None)]
    assert specs[1].row(16) == "snapkv:budget=256,obs_window=16" and specs[3].row(4) == "full kv4"
    repeated = suite_cells.parse_policies(["full", "snapkv:budget=256,obs_window=16; hshare@a:preset=long"])
    assert repeated == specs[:3]
    for bad, message in [("budget=1;full", "malformed"), ("full;full", "twice"), ("", "empty"), (" ; ", "empty"),
                         ("full:kv_bits=x", "not an integer"), ("snapkv:", "malformed"), ("a@:x=1", "malformed")]:
        with pytest.raises(common.UsageError, match=message):
            suite_cells.parse_policies(bad)


def test_parse_tasks():
    assert suite_cells.parse_tasks("needle, longbench:multi_news,ruler:x.jsonl") == ["needle", "longbench:multi_news",
                                                                                    "ruler:x.jsonl"]
    for bad in ("nope", "longbench", "needle,needle", "needle:x"):
        with pytest.raises(common.UsageError):
            suite_cells.parse_tasks(bad)


def test_report_ratios_and_table():
    def rec(row, task, alloc, read, score, policy="x", args="", steps=10, seconds=1.0):
        return {"row": row, "task": task, "policy": policy, "label": "", "policy_args": args, "kv_bits": 16,
                "status": "ok", "metric": "accuracy", "score": score,
                "usage": {"kv_allocated": alloc, "kv_read": read, "decode_steps": steps, "decode_seconds": seconds}}
    records = [rec("full", "needle", 800, 800, 100, "full"), rec("full", "passkey", 200, 200, 50, "full"),
               rec("s", "needle", 100, 50, 0, "streaming", seconds=0.5), rec("s", "passkey", 100, 100, 50, "streaming"),
               {"row": "nope", "task": "needle", "policy": "nope", "label": "", "policy_args": "", "kv_bits": 16,
                "status": "skipped", "error": "unknown policy 'nope'"}]
    suite_report.compression(records)
    assert records[2]["kv_ratio"] == 8 and records[2]["read_ratio"] == 16 and records[3]["kv_ratio"] == 2
    s = suite_report.row_summary(records[2:4])
    assert s["kv_ratio"] == pytest.approx(1000 / 200) and s["read_ratio"] == pytest.approx(1000 / 150)
    assert s["decode_tokens_per_s"] == pytest.approx(20 / 1.5)
    md = suite_report.markdown(records, ["needle", "passkey"], ["full", "s", "nope"])
    assert "| `s` | 0.0 | 50.0 | 5.00x | 6.67x | 13.3 |" in md
    assert "| `nope` | skipped |  |" in md and "- `nope` (needle): skipped: unknown policy 'nope'" in md


# --------------------------------------------------------------------------- suite: end to end (tiny model)

TINY = ["--lengths", "200", "--depths", "0.5", "--context-length", "64", "--eval-tokens", "4", "--new-tokens", "6",
        "--samples", "1", "--limit", "1", "--max-context", "160", "--max-new-tokens", "6", "--proximal", "24",
        "--n-sink", "4", "--last", "8"]


@pytest.fixture
def suite_env(tiny_loaded, monkeypatch, essays, multi_news):
    """suite.run uses the already loaded tiny model, and counts (and can interrupt) suite_cells.run_task calls."""
    monkeypatch.setattr(suite.common, "load", lambda args: tiny_loaded)
    calls, real = [], suite_cells.run_task
    state = {"interrupt_at": None}

    def counting(ctx, cell, new_policy):
        calls.append((cell.row, cell.task))
        if state["interrupt_at"] == len(calls):
            raise KeyboardInterrupt
        return real(ctx, cell, new_policy)
    monkeypatch.setattr(suite_cells, "run_task", counting)
    return calls, state


def test_suite_end_to_end_and_resume(suite_env, tmp_path, capsys):
    calls, _ = suite_env
    out = tmp_path / "run"
    argv = ["--policies", "full;streaming:budget=32;nope;full:kv_bits=4", "--tasks",
            "needle,passkey,perplexity,longbench:multi_news,agreement,proximal", "--out", out, *TINY]
    code, stdout, err = run_main(suite, capsys, *argv)
    assert code == 0, err
    assert "[1/21] (model) x proximal ..." in err and "min left" in err
    r = json.loads((out / "results.json").read_text())
    cells = {(c["row"], c["task"]): c for c in r["cells"]}
    assert len(cells) == 21 and r["rows"] == ["full", "streaming:budget=32", "nope", "full kv4"]
    tasks = ["needle", "passkey", "perplexity", "longbench:multi_news", "agreement"]
    for row in ("full", "streaming:budget=32"):
        for t in tasks:
            c = cells[row, t]
            assert c["status"] == "ok" and c["score"] is not None and c["usage"]["kv_allocated"] > 0, c
    assert all(cells["nope", t]["status"] == "skipped" and "unknown policy 'nope'" in cells["nope", t]["error"]
               for t in tasks)
    assert all(cells["full kv4", t]["status"] == "ok" for t in tasks)            # 4-bit storage: a real row
    full, stream = (cells[row, "agreement"] for row in ("full", "streaming:budget=32"))
    assert full["score"] == 100.0 and full["first_divergence"] == 6 and full["kv_ratio"] == 1.0
    assert stream["kv_ratio"] > 1 and stream["usage"]["kv_allocated"] < full["usage"]["kv_allocated"]
    assert cells["full", "perplexity"]["metric"] == "perplexity" and not cells["full", "perplexity"]["higher_is_better"]
    assert set(cells["(model)", "proximal"]["proximal_agreement"]) == {"24"}
    # the report files
    md = (out / "results.md").read_text()
    assert md.startswith("| policy | needle (acc %) | passkey (acc %) | perplexity (ppl, lower is better) | "
                         "multi_news (ROUGE-L) | agreement (token agreement %) | first divergence | KV compression")
    assert "| `full` | " in md and "Proximal-only next-token agreement" in md and "`nope` (all tasks): skipped" in md
    assert md in stdout
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 21 and table[0].keys() >= {"row", "task", "status", "score", "kv_ratio", "decode_tokens_per_s"}
    pytest.importorskip("matplotlib")
    assert (out / "score_vs_compression.png").stat().st_size > 10_000

    # run again: nothing finished is recomputed (the skipped rows are retried, which costs nothing)
    n_run, stamps = len(calls), {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()}
    code, _, err = run_main(suite, capsys, *argv)
    assert code == 0, err
    ok = {c["row"] + c["task"] for c in r["cells"] if c["status"] == "ok"}
    assert len(calls) == n_run and f"{len(ok)} finished before, {21 - len(ok)} to run" in err
    again = json.loads((out / "results.json").read_text())
    for c in again["cells"]:
        if c["row"] + c["task"] in ok:
            assert c == cells[c["row"], c["task"]] | {"kv_ratio": c["kv_ratio"], "read_ratio": c["read_ratio"]}
    for p in (out / "cells").iterdir():
        if json.loads(p.read_text())["status"] == "ok":
            assert p.stat().st_mtime_ns == stamps[p.name]
    # other settings are other cells
    code, _, err = run_main(suite, capsys, *[a if a != "6" else "5" for a in argv])
    assert code == 0 and len(calls) > n_run


def test_suite_interrupted_then_resumed_redoes_no_finished_cell(suite_env, tmp_path, capsys):
    calls, state = suite_env
    out = tmp_path / "run"
    argv = ["--policies", "full", "--policies", "streaming:budget=32", "--tasks", "perplexity,agreement", "--out", out, *TINY]
    state["interrupt_at"] = 3                                       # Ctrl-C during the third cell
    code, _, err = run_main(suite, capsys, *argv)
    assert code == 130 and "interrupted: 2/4 cells finished" in err
    finished = list(calls[:2])
    assert json.loads((out / "results.json").read_text())["interrupted"] is True
    assert len(list((out / "cells").glob("*.json"))) == 2
    state["interrupt_at"], calls[:] = None, []
    code, _, err = run_main(suite, capsys, *argv)
    assert code == 0, err
    assert calls == [("streaming:budget=32", "perplexity"), ("streaming:budget=32", "agreement")]
    assert not set(calls) & set(finished)
    r = json.loads((out / "results.json").read_text())
    assert [c["status"] for c in r["cells"]] == ["ok"] * 4 and "interrupted" not in r


def test_suite_failing_cell_is_an_error_not_a_crash(suite_env, tmp_path, capsys, monkeypatch):
    real = suite_cells.run_task

    def flaky(ctx, cell, new_policy):
        if cell.row == "streaming:budget=32":
            raise RuntimeError("boom\nsecond line")
        return real(ctx, cell, new_policy)
    monkeypatch.setattr(suite_cells, "run_task", flaky)
    out = tmp_path / "run"
    code, stdout, err = run_main(suite, capsys, "--policies", "full;streaming:budget=32", "--tasks", "perplexity",
                                 "--out", out, "--no-plot", *TINY)
    assert code == 0, err
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert [c["status"] for c in cells] == ["ok", "error"] and cells[1]["error"] == "RuntimeError: boom"
    assert "Traceback" in cells[1]["traceback"] and "| `streaming:budget=32` | error |" in stdout


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "needle"], "--policies is required without --preset"),
    (["--policies", "full", "--tasks", "nope"], "unknown task 'nope'"),
    (["--policies", "full", "--tasks", "longbench:nope"], "no LongBench task 'nope'"),
    (["--policies", "full", "--tasks", "needle", "--depths", "2"], "--depths must lie in [0, 1]"),
    (["--policies", "full", "--tasks", "needle", "--kv-bits", "x"], "--kv-bits 'x': expected"),
    (["--policies", "full;full:kv_bits=4", "--tasks", "needle", "--kv-bits", "16,4"], "runs 'full kv4' twice"),
    (["--policies", "full", "--tasks", "perplexity", "--context-length", "9000"], "exceeds the model's context"),
])
def test_suite_bad_input_is_one_line_exit_2(argv, message, suite_env, tmp_path, capsys):
    code, _, err = run_main(suite, capsys, "--out", tmp_path / "o", *argv)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_presets_follow_the_registry():
    """Every registered policy is a row of the accuracy preset, and every eviction policy with a budget one of
    the quick preset, without editing them (a new policy is not silently left out)."""
    from cache import POLICIES
    accuracy = {spec.name for spec in suite_cells.parse_policies(suite.accuracy_policies())}
    quick = {spec.name for spec in suite_cells.parse_policies(suite.QUICK_POLICIES)}
    assert accuracy == set(POLICIES)
    assert {"knorm", "tova", "streaming"} <= set(suite.BUDGETED) <= quick
