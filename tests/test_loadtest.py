"""scripts/loadtest.py against this repository's serve.py on the tiny random checkpoint (bounded: a few short
requests), its workloads, and the clear refusal of --peer llama.cpp where llama-cpp-python is missing."""
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_serve import running

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import loadtest  # noqa: E402

SERVER_FLAGS = "--max-batch 2 --max-new-tokens-limit 16 --max-seq-length 512"


def test_workloads_share_what_they_should():
    assert loadtest.workload("short", 2, None) == ["Question 1: " + loadtest.QUESTIONS[0],
                                                   "Question 2: " + loadtest.QUESTIONS[1]]
    docs = loadtest.workload("docs", 3, 100)
    assert len(set(docs)) == 3 and all(350 < len(d) < 600 for d in docs)       # ~100 tokens of text each
    one = loadtest.workload("one-doc", 3, 100)
    head = one[0].split("Question 1")[0]
    assert all(q.startswith(head) for q in one) and len(set(one)) == 3       # one document, three questions
    assert loadtest.percentile([3, 1, 2], 0.5) == 2 and loadtest.percentile([1, 2], 0.95) == pytest.approx(1.95)
    assert loadtest.percentile([], 0.5) is None


def test_client_measures_a_running_server(tiny_dir):
    """The asyncio client in process, completions API, one-doc: every request answered, timings measured."""
    flags = SERVER_FLAGS.split()
    with running(tiny_dir, *flags) as (client, _):
        prompts = loadtest.workload("one-doc", 4, 60)
        results, wall = asyncio.run(loadtest.run_workload(str(client.base_url), prompts, 2, "completions", None,
                                                          8, {}, 120))
        rss = loadtest.rss_metric(str(client.base_url).rstrip("/"))       # this process: the server runs in it
        assert abs(rss / loadtest.rss_of(os.getpid()) - 1) < 0.05
    row = loadtest.summarize("ours", results, wall)
    assert (row["ok"], row["errors"]) == (4, 0), row
    assert 4 <= row["output_tokens"] <= 32 and row["prompt_tokens"] > 4 * 60 // 2
    assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"] < wall and row["requests_per_s"] > 0
    assert row["itl_p50_s"] is not None and row["itl_p50_s"] >= 0


def test_one_command_starts_our_server_and_reports(tiny_dir, tmp_path):
    """--server starts serve.py on a free port, runs the chat workload, prints the table, writes the JSON."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "scripts/loadtest.py", "--server", str(tiny_dir), "--server-flags", SERVER_FLAGS,
                        "--workload", "docs", "--requests", "3", "--concurrency", "2", "--max-tokens", "6",
                        "--doc-tokens", "50", "--threads", "1", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())
    assert (row["side"], row["ok"], row["errors"], row["workload"]) == ("ours", 3, 0, "docs"), row
    assert "| ours | 3 | 0 |" in r.stdout


def test_peer_needs_llama_cpp():
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here: the peer runs for real")
    r = subprocess.run([sys.executable, "scripts/loadtest.py", "--peer", "llama.cpp"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == loadtest.PEER_MISSING


def test_a_long_run_reports_a_flat_rss(tiny_dir, tmp_path):
    """--workload short, 60 requests after 8 warm-up ones: the started server's RSS is read before and after from
    /proc and grows by less than 10% (a loose bound for a short run; docs/serving.md has the 500-request runs)."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "scripts/loadtest.py", "--server", str(tiny_dir), "--server-flags", SERVER_FLAGS,
                        "--workload", "short", "--requests", "60", "--warmup", "8", "--concurrency", "8",
                        "--max-tokens", "8", "--threads", "1", "--api", "completions", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())
    assert (row["ok"], row["errors"]) == (60, 0), row
    assert 100 < row["rss_start_mib"] < 4000 and row["rss_end_mib"] > 0
    assert row["rss_growth_pct"] == pytest.approx(100 * (row["rss_end_mib"] / row["rss_start_mib"] - 1))
    assert row["rss_growth_pct"] < 10, row
