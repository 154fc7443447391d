"""eval/kvpress_peer.py: kvpress as a peer in the suite (pairing, resume, errors; the real side where installed)."""
import json
import os
import subprocess
import sys

import pytest

from eval import kvpress_peer, suite
from eval.kvpress_peer import Item
from tests import test_eval

tiny_loaded = test_eval.tiny_loaded


def ours(policy, args, score, protocol="agnostic", task="needle"):
    return {"row": f"{policy}:{args}", "task": task, "policy": policy, "label": "", "policy_args": args,
            "kv_bits": 16, "protocol": protocol, "status": "ok", "score": score, "metric": "accuracy",
            "results": [{}, {}]}


def fake_side(answers_by_method, calls):
    """A stand-in for the child process: answers each request with answers_by_method[method]."""
    def run_side(python, job, on_done):
        calls.append(job)
        for j in job["jobs"]:
            on_done({"method": j["method"], "ratio": j["ratio"], "seconds": 0.5,
                     "answers": [answers_by_method[j["method"]]] * len(job["requests"])})
    return run_side


ITEMS = [Item(list(range(10)), 7, 4, lambda a: float("yes" in a)), Item(list(range(12)), 9, 4, lambda a: 0.0)]


def test_requests_split_at_the_question_or_before_the_last_token():
    assert kvpress_peer.request(ITEMS[0], "agnostic") == {"context": list(range(7)), "question": [7, 8, 9],
                                                          "max_new_tokens": 4}
    assert kvpress_peer.request(ITEMS[0], "aware")["question"] == [9]
    with pytest.raises(ValueError, match="inside the prompt"):
        kvpress_peer.request(Item([1, 2], 2, 4, None), "agnostic")


def test_run_scores_pairs_and_resumes_with_a_fake_side(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(kvpress_peer, "run_side", fake_side({"full": " yes ", "snapkv": "no"}, calls))
    pairs = kvpress_peer.jobs(["full", "snapkv"], [0.5, 0.75])
    assert pairs == [("full", 0.0), ("snapkv", 0.5), ("snapkv", 0.75)]
    args = (tmp_path, "python", "ckpt", "float32", "needle", {"lengths": "1000"}, "agnostic", "accuracy", ITEMS)
    records = kvpress_peer.run(*args, pairs)
    assert [r["row"] for r in records] == ["kvpress:full agnostic", "kvpress:snapkv ratio=0.5 agnostic",
                                           "kvpress:snapkv ratio=0.75 agnostic"]
    assert [r["score"] for r in records] == [50.0, 0.0, 0.0] and records[0]["results"][0]["answer"] == "yes"
    assert len(calls) == 1 and len(calls[0]["jobs"]) == 3 and calls[0]["requests"][1]["question"] == [9, 10, 11]
    assert kvpress_peer.run(*args, pairs) == records and len(calls) == 1       # finished cells are not redone
    kvpress_peer.run(*args[:-2], "string_match_all", ITEMS, pairs[:1])         # same identity: still no call
    assert len(calls) == 1

    mine = [ours("full", "", 100.0), ours("snapkv", "ratio=0.5", 50.0), ours("snapkv", "budget=256", 0.0),
            ours("knorm", "ratio=0.5", 50.0), ours("snapkv", "ratio=0.5", 100.0, protocol="aware")]
    columns, rows = kvpress_peer.paired(mine + records)
    assert columns == ["method", "ratio", "protocol", "task", "ours", "kvpress"]
    assert rows == [["full", "0", "agnostic", "needle", "2/2", "1/2"],       # needle: hits / prompts
                    ["snapkv", "0.5", "agnostic", "needle", "1/2", "0/2"],
                    ["snapkv", "0.75", "agnostic", "needle", "-", "0/2"],
                    ["knorm", "0.5", "agnostic", "needle", "1/2", "-"],
                    ["snapkv", "0.5", "aware", "needle", "2/2", "-"]]
    columns, rows = kvpress_peer.doc_table(mine + records, ["needle"])
    assert columns == ["method", "ratio", "protocol", "side", "needle"]
    assert rows[:4] == [["full", "0", "agnostic", "ours", "2/2"], ["full", "0", "agnostic", "kvpress", "1/2"],
                        ["snapkv", "0.5", "agnostic", "ours", "1/2"], ["snapkv", "0.5", "agnostic", "kvpress", "0/2"]]
    prefill_only = ours("knorm", "ratio=0.5,decode_evict=false", 0.0)   # kvpress's rule: a column of its own
    columns, rows = kvpress_peer.paired(mine + records + [prefill_only])
    assert columns[4:] == ["ours", "ours decode_evict=false", "kvpress"]
    assert ["knorm", "0.5", "agnostic", "needle", "1/2", "0/2", "-"] in rows
    assert kvpress_peer.side_of(ours("knorm", "ratio=0.5,decode_evict=true", 0.0)) == (0.5, "ours")   # the default


def test_a_failing_side_gives_error_records(tmp_path, monkeypatch):
    monkeypatch.setattr(kvpress_peer, "run_side", lambda python, job, on_done: "kvpress exited with status 1: boom")
    [r] = kvpress_peer.run(tmp_path, "python", "ckpt", "float32", "needle", {}, "agnostic", "accuracy", ITEMS,
                           [("tova", 0.5)])
    assert r["status"] == "error" and r["error"].endswith("boom") and r["row"] == "kvpress:tova ratio=0.5 agnostic"


def test_the_real_child_reports_its_error(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'Traceback...' >&2\necho 'ModuleNotFoundError: kvpress' >&2\nexit 1\n")
    python.chmod(0o755)
    assert kvpress_peer.run_side(str(python), {"jobs": []}, None) == \
        "kvpress exited with status 1: ModuleNotFoundError: kvpress"


@pytest.mark.parametrize("argv, message", [
    (["--peer-presses", "snapkv,nope"], "--peer-presses: unknown nope"),
    (["--peer-ratios", "0.5,1"], "--peer-ratios must be numbers in (0, 1)"),
    ([], "kvpress is not installed for"),
])
def test_peers_without_kvpress_or_with_bad_options_is_one_line(argv, message, tmp_path, capsys):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")      # an interpreter without kvpress
    python.chmod(0o755)
    code = suite.main(["--checkpoint", str(suite.common.DEFAULT_CHECKPOINT), "--policies", "full", "--tasks", "needle",
                       "--out", str(tmp_path / "out"), "--peers", "kvpress", "--kvpress-python", str(python), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    if not argv:
        assert "pip install -e '.[kvpress]'" in err


def test_peers_alone_capped_ruler_rows_on_the_suites_device(monkeypatch, tiny_loaded, tmp_path, capsys):
    """--peers without --policies runs kvpress's rows alone; --max-new-tokens caps the RULER-format rows'
    generation lengths (the prompts unchanged) on both sides; the child gets the suite's device."""
    calls = []
    monkeypatch.setattr(suite.common, "load", lambda args: tiny_loaded)
    monkeypatch.setattr(kvpress_peer, "check_available", lambda python, checkpoint: None)
    monkeypatch.setattr(kvpress_peer, "run_side", fake_side({"full": "no"}, calls))
    out = tmp_path / "run"
    argv = ["--tasks", "ruler_synth:niah_single_1", "--ruler-length", "400", "--ruler-samples", "2", "--protocol",
            "agnostic", "--peers", "kvpress", "--peer-presses", "full", "--no-plot", "--quiet", "--out", str(out)]
    assert suite.main(argv + ["--max-new-tokens", "5"]) == 0, capsys.readouterr().err
    [job] = calls
    assert job["device"] == "cpu" and [r["max_new_tokens"] for r in job["requests"]] == [5, 5]
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert [c["row"] for c in cells] == ["kvpress:full agnostic"] and cells[0]["params"]["max_new_tokens"] == 5
    assert suite.main(argv) == 0 and [r["max_new_tokens"] for r in calls[1]["requests"]] == [128, 128]
    assert calls[1]["requests"][0]["context"] == job["requests"][0]["context"]


def test_peers_need_a_hf_checkpoint(tmp_path):
    with pytest.raises(kvpress_peer.PeerError, match="not a HF folder"):
        kvpress_peer.check_available(sys.executable, str(tmp_path))


def kvpress_python() -> str:
    python = os.environ.get("KVPRESS_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import kvpress"], capture_output=True).returncode:
        pytest.skip(f"kvpress is not installed for {python} (pip install -e '.[kvpress]'; KVPRESS_PYTHON=...)")
    return python


def test_kvpress_full_answers_like_our_engine(default_dir, tmp_path):
    """The real side: with no press kvpress's pipeline gives our engine's greedy answer on the same ids."""
    python = kvpress_python()
    from eval import common, measure
    loaded = common.load(suite.policy_namespace(suite.build_parser().parse_args(
        ["--checkpoint", str(default_dir), "--out", str(tmp_path)]), None, 16))
    items = kvpress_peer.needle_items(loaded.tokenizer, common.read_text_folder(common.ESSAYS), [400], [0.5])
    records = kvpress_peer.run(tmp_path, python, str(default_dir), "float32", "needle", {}, "agnostic", "accuracy",
                               items, [("full", 0.0), ("streaming", 0.5)])
    answer, _ = measure.answer(loaded, None, items[0].ids, items[0].split, 32, "agnostic")
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert records[0]["results"][0]["answer"] == answer and records[0]["score"] == 100.0


def test_main_writes_the_docs_table_from_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(kvpress_peer, "run_side", fake_side({"knorm": "yes"}, []))
    kvpress_peer.run(tmp_path, "python", "ckpt", "float32", "needle", {}, "agnostic", "accuracy", ITEMS,
                     [("knorm", 0.5)])
    (tmp_path / "cells" / "ours.json").write_text(json.dumps(ours("knorm", "ratio=0.5", 100.0)))
    out = tmp_path / "kvpress.json"
    assert kvpress_peer.main([str(tmp_path / "cells"), "--out", str(out), "--command", "c", "--date", "d",
                              "--machine", "m"]) == 0
    table = json.loads(out.read_text())
    assert table["section"] == "13. Accuracy table" and table["machine"] == {"recorded": "m"}
    assert table["rows"] == [["knorm", "0.5", "agnostic", "ours", "2/2"], ["knorm", "0.5", "agnostic", "kvpress", "1/2"]]
    assert kvpress_peer.main([str(tmp_path / "cells"), "--out", str(out), "--command", "c", "--date", "d",
                              "--machine", "m", "--tasks", "needle,passkey", "--order", "3"]) == 0
    table = json.loads(out.read_text())
    assert table["order"] == 3 and table["columns"][-2:] == ["needle", "passkey"] and table["rows"][0][-1] == "-"


def test_a_press_that_fails_alone_is_an_error_row(tmp_path, monkeypatch):
    def run_side(python, job, on_done):
        on_done({"method": "pyramidkv", "ratio": 0.5, "seconds": 1.0, "error": "RuntimeError: sizes"})
        on_done({"method": "knorm", "ratio": 0.5, "seconds": 1.0, "answers": ["yes", "yes"]})
    monkeypatch.setattr(kvpress_peer, "run_side", run_side)
    bad, good = kvpress_peer.run(tmp_path, "python", "ckpt", "float32", "needle", {}, "agnostic", "accuracy", ITEMS,
                                 [("pyramidkv", 0.5), ("knorm", 0.5)])
    assert bad["status"] == "error" and bad["error"] == "RuntimeError: sizes" and good["score"] == 50.0
    assert len(list((tmp_path / "cells").glob("*.json"))) == 1            # the failure is retried next time
