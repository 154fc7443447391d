"""scripts/reproduce.py: its renderer on small fixture tables, the converters of each tool's output
on fixture rows (nothing is run), and that docs/results.md and the README's headline are what the
checked-in results/*.json render to."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
reproduce = importlib.util.module_from_spec(_spec)
sys.modules["reproduce"] = reproduce          # dataclasses look their module up there
_spec.loader.exec_module(reproduce)

CAPTURED = {"cpu": "Test CPU 9000", "isa": "AVX512", "logical_cpus": 2, "threads": 2, "read_bandwidth_gbs": 41.5,
            "torch": "2.13.0+cpu", "omp_wait_policy": "ACTIVE", "python": "3.12.3", "commit": "abc1234"}


def table(topic, section, order=0, **extra):
    return {"topic": topic, "section": section, "title": f"{topic} title", "order": order, "size": "full",
            "command": f"python scripts/benchmark.py --policies {topic}", "date": "2026-11-25 22:50 UTC",
            "machine": CAPTURED, "columns": ["policy", "tok/s"], "rows": [[f"`{topic}`", "12.5"]], **extra}


def test_render_orders_sections_and_tables_and_names_command_date_machine():
    tables = [table("b", "10. Later"), table("a", "2. Earlier", order=2), table("c", "2. Earlier", order=1),
              table("rec", "3. Recorded", machine={"recorded": "CPU-2c as recorded then"}, notes="A note.")]
    text = reproduce.render(tables)
    heads = [line for line in text.splitlines() if line.startswith("#")]
    assert heads == ["# Results", "## 2. Earlier", "### c title", "### a title", "## 3. Recorded", "### rec title",
                     "## 10. Later", "### b title"]
    assert "- **Command**: `python scripts/benchmark.py --policies a`" in text
    assert "- **Date**: 2026-11-25 22:50 UTC" in text
    assert ("- **Machine**: Test CPU 9000 (AVX512), 2 logical CPUs, 2 threads, read bandwidth 41.5 GB/s, "
            "torch 2.13.0+cpu, OMP_WAIT_POLICY=ACTIVE, Python 3.12.3, commit abc1234") in " ".join(text.split())
    assert "- **Machine**: CPU-2c as recorded then" in text
    assert "| `rec` | 12.5 |\n\nA note." in text


def test_render_marks_quick_tables_and_failures():
    text = reproduce.render([table("q", "1. Q", size="quick", error="exit status 2: boom")])
    assert "(quick size)" in text and "**Failed**: exit status 2: boom" in text


def test_markdown_table_refuses_ragged_rows_and_escapes_pipes():
    assert reproduce.markdown_table(["a"], [["x|y"]])[-1] == "| x\\|y |"
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        reproduce.markdown_table(["a"], [["x", "y"]])


def test_load_tables_names_the_file_missing_a_key(tmp_path):
    bad = table("x", "1. X")
    del bad["machine"]
    (tmp_path / "x.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="x.json: missing machine"):
        reproduce.load_tables(tmp_path)
    bad = table("x", "1. X", command=[])
    (tmp_path / "x.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="x.json: missing command"):
        reproduce.load_tables(tmp_path)


def test_headline_is_replaced_between_its_markers_only():
    peers = table("peers", "9. W")
    readme = f"intro\n{reproduce.HEADLINE[0]}\nold table\n{reproduce.HEADLINE[1]}\noutro\n"
    new = reproduce.replace_headline(readme, peers)
    assert new.startswith("intro\n") and new.endswith("\noutro\n") and "old table" not in new
    assert "| `peers` | 12.5 |" in new and "2026-11-25 22:50 UTC" in new
    with pytest.raises(ValueError, match="no headline markers"):
        reproduce.replace_headline("no markers", peers)


def bench_row(policy, kv_bits=16, tps=100.0, **extra):
    return {"mode": "e2e", "policy": policy, "policy_args": "", "kv_bits": kv_bits, "status": "ok",
            "decode_tokens_per_s": tps, "decode_step_ms": 8000 / tps, "kv_bytes_allocated": 3 * 2 ** 20,
            "fraction_of_bound": 0.5, "read_bandwidth_gbs": 40.0, **extra}


def test_benchmark_rows_become_the_speed_and_kivi_tables(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([bench_row("full", speedup_vs_full=1.0),
                                bench_row("snapkv", tps=250.0, speedup_vs_full=2.5),
                                {**bench_row("pod"), "status": "skipped", "error": "no packed format"}]))
    cols, rows = reproduce.speed_rows(path)
    assert rows[1] == ["`snapkv`", "250.0", "2.50x", "32.0", "3.0 MiB", "50%"]
    assert rows[2][:2] == ["`pod`", "skipped"] and len(rows[2]) == len(cols)
    path.write_text(json.dumps([bench_row("full", 32, 100.0), bench_row("ds", 32, 160.0), bench_row("full", 16, 125.0),
                                {**bench_row("ds", 16), "status": "skipped"}, bench_row("full", 4, 150.0),
                                bench_row("ds", 4, 180.0)]))
    cols, rows = reproduce.kivi_rows(path)
    assert cols[1:3] == ["`full` tok/s (x its fp32, x `full`)", "`ds` tok/s (x its fp32, x `full`)"]
    assert rows[1][:3] == ["bfloat16 (kv16)", "125.0 (1.25x, 1.00x)", "skipped"]
    assert rows[2] == ["KIVI 4-bit", "150.0 (1.50x, 1.00x)", "180.0 (1.12x, 1.20x)", "3.0 MiB"]
    assert reproduce.bandwidth_of(path) == 40.0               # reused by the later benchmark runs
    assert reproduce.bandwidth_of(tmp_path / "missing.json") is None
    assert reproduce.bandwidth_of(tmp_path) is None           # the eval suite's output folder


def test_memory_rows_say_whether_the_batch_was_run(tmp_path):
    row = {"mode": "memory", "policy": "full", "policy_args": "", "kv_bits": 16, "status": "ok",
           "memory_limit_bytes": 2 * 2 ** 30, "max_batch_size": 153, "verified": None,
           "state_bytes_per_seq": 4 * 2 ** 20, "workspace_bytes_per_seq": 2 * 2 ** 20, "base_bytes": 967 * 2 ** 20}
    path = tmp_path / "memory.json"
    path.write_text(json.dumps([row, {**row, "verified": True, "max_batch_size": 150}]))
    _, rows = reproduce.memory_rows(path)
    assert rows == [["`full`", 16, "2 GiB", 153, "estimate", "6.0 MiB", "967 MiB"],
                    ["`full`", 16, "2 GiB", 150, "yes", "6.0 MiB", "967 MiB"]]


def test_suite_cells_become_the_accuracy_table(tmp_path):
    def cell(row, task, metric, score, kv_read=None, status="ok"):
        return {"row": row, "task": task, "metric": metric, "score": score, "status": status,
                "usage": {"kv_read": kv_read} if kv_read else None}
    (tmp_path / "results.json").write_text(json.dumps({
        "tasks": ["needle", "perplexity"], "rows": ["full", "snapkv:budget=64"],
        "cells": [cell("full", "needle", "accuracy", 66.666, 2 ** 20), cell("full", "perplexity", "perplexity", 22.114,
                                                                            3 * 2 ** 20),
                  cell("snapkv:budget=64", "needle", "accuracy", None, status="error")]}))
    cols, rows = reproduce.accuracy_rows(tmp_path)
    assert cols == ["row", "needle (accuracy)", "perplexity", "KV read per step"]
    assert rows == [["`full`", "66.7", "22.11", "3.0 MiB"], ["`snapkv:budget=64`", "error", "", ""]]


def test_peer_rows_are_relative_to_llama_cpp_of_the_same_context(tmp_path):
    path = tmp_path / "peers.json"
    path.write_text(json.dumps([
        {"side": "ours x.gguf", "context": 512, "tok_s": 120.0, "peak_rss": 457 * 2 ** 20, "model_rss": 226 * 2 ** 20},
        {"side": "llama.cpp", "context": 512, "tok_s": 100.0, "peak_rss": 195 * 2 ** 20, "model_rss": 153 * 2 ** 20},
        {"side": "hf", "context": 512, "error": "transformers is not installed"}]))
    cols, rows = reproduce.peers_rows(path)
    assert cols[3] == "vs llama.cpp" and rows[0] == ["ours x.gguf", 512, "120.0", "1.20x", "457 MiB", "226 MiB"]
    assert rows[2][2] == "error"
    path.write_text(json.dumps([                          # no llama.cpp: relative to HF
        {"side": "ours x.gguf", "context": 64, "tok_s": 15.0, "peak_rss": 2 ** 20, "model_rss": 2 ** 20},
        {"side": "hf", "context": 64, "tok_s": 3.0, "peak_rss": 2 ** 20, "model_rss": 2 ** 20}]))
    cols, rows = reproduce.peers_rows(path)
    assert cols[3] == "vs hf" and rows[0][3] == "5.00x"


def test_the_published_results_are_the_rendered_json():
    """docs/results.md and the README's headline are generated: an edit by hand fails here."""
    tables = reproduce.load_tables(reproduce.RESULTS)
    assert {"speed", "kivi", "accuracy", "peers"} <= {t["topic"] for t in tables}
    assert reproduce.DOC.read_text() == reproduce.render(tables), \
        "docs/results.md differs from results/*.json: run python scripts/reproduce.py --render"
    readme = reproduce.README.read_text()
    peers = next(t for t in tables if t["topic"] == "peers")
    assert reproduce.replace_headline(readme, peers) == readme, "README headline: run scripts/reproduce.py --render"
