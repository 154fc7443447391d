"""scripts/benchmark.py and its package scripts/bench/: JSON/CSV schema, atomic writes and Ctrl-C,
ratios, the attention-operator, context-sweep and memory-limit modes, the policy-spec lists of
--policies, CLI errors, and no recompilation inside compiled decode loops.

Runs use tiny contexts (32-64 tokens), 4 decode steps and a fixed --bandwidth-gbs.  The tests of
the benchmark's mechanics run on `tiny_dir` (tests/conftest.py: a random 3-layer Llama with the
default model's tokenizer, vocabulary and head_dim); test_e2e_real_model_row and
test_attention_operator_rows run the real default model."""
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import cache
import engine
from cache import PolicySpec
from cache.params import param
from cache.full import FullCache
from model import ModelArgs, Transformer
from runtime.steps import compiled_steps, prefill_step
from tests.helpers import default_sigint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import benchmark  # noqa: E402
from bench import cli, grid, measure, report, specs  # noqa: E402

FAST = ["--bandwidth-gbs", "40", "--decode-steps", "4", "--warmup-steps", "1", "--repeats", "1"]
SCHEMA = {"policy": str, "policy_args": str, "batch_size": int, "context_length": int, "kv_bits": int,
          "decode_steps": int, "prefill_tokens_per_s": float, "decode_tokens_per_s": float,
          "decode_tokens_per_s_per_seq": float, "kv_bytes_allocated": int, "kv_bytes_live": int,
          "peak_memory_bytes": int, "bandwidth_bound_tokens_per_s": float, "device": str, "dtype": str,
          "torch_version": str, "compile": bool}


@dataclass(eq=False)
class ProbeCache(FullCache):
    """A second registered policy (the dense cache under another name, with one parameter), so the
    tests exercise the registry path, per-policy arguments and pairwise ratios."""
    name = "probe"
    storage_kind = "own"        # another policy than `full`: --kv-bits never swaps its storage
    window: int = param(8, "a dummy parameter")

    def describe(self) -> dict:
        return {**super().describe(), "window": self.window}


@pytest.fixture
def probe_policy(monkeypatch):
    monkeypatch.setitem(cache.POLICIES, "probe", ProbeCache)


def run(capsys, checkpoint, *argv):
    rc = benchmark.main(["--checkpoint", str(checkpoint), *FAST, *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def per_slot_bytes(args) -> int:
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * 4  # K and V, float32, per token, per sequence


def dir_args(checkpoint) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((checkpoint / "config.json").read_text()))


# --------------------------------------------------------------------------- end to end

def test_e2e_rows_schema_csv_ratios_and_skipped_kv_bits(capsys, tiny_dir, probe_policy, tmp_path):
    out_json, out_csv, out_png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    rc, out, err = run(capsys, tiny_dir, "--policies", "probe:window=16", "--policies", "full",  # repeated flag
                       "--batch-sizes", "1,2", "--context-lengths", "32,48", "--kv-bits", "16,4",
                       "--kv-residual", "32",     # the default R 128 ring alone outweighs a 48-token fp32 cache
                       "--speedup-vs", "full", "--json", str(out_json), "--csv", str(out_csv), "--plot", str(out_png))
    assert rc == 0, err
    assert "OMP_WAIT_POLICY=" in out and "bound t/s" in out and "vs full" in out
    rows = json.loads(out_json.read_text())
    ok = [r for r in rows if r["status"] == "ok"]
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert len(ok) == 12 and len(skipped) == 4 and len(rows) == 16      # probe has no KIVI storage
    assert all(r["kv_bits"] == 4 and r["policy"] == "probe" and "no KIVI storage" in r["error"] for r in skipped)
    assert all(r["decode_tokens_per_s"] is None for r in skipped)
    args = json.loads((tiny_dir / "config.json").read_text())
    slot = 2 * args["num_hidden_layers"] * args["num_key_value_heads"] * args["head_dim"] * 4
    for r in ok:
        for key, kind in SCHEMA.items():
            assert isinstance(r[key], kind), (key, r[key])
        B, T = r["batch_size"], r["context_length"]
        assert r["mode"] == "e2e" and r["decode_steps"] == 4 and r["compile"] is False
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["torch_version"] == torch.__version__
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert math.isclose(r["decode_tokens_per_s_per_seq"] * B, r["decode_tokens_per_s"])
        # bytes come from the cache's own buffers: prompt + 1 warm-up + 4 timed steps live, 16 spare slots
        if r["kv_bits"] == 16:
            assert r["kv_bytes_allocated"] == B * slot * (T + 1 + 4 + specs.CAPACITY_MARGIN)
            assert r["kv_bytes_live"] == B * slot * (T + 1 + 4)
        else:
            assert r["policy_config"]["kv_bits"] == 4
            assert 0 < r["kv_bytes_allocated"] < B * slot * (T + 1 + 4 + specs.CAPACITY_MARGIN)
        assert r["peak_memory_bytes"] > r["weight_bytes"] > 0
        bound = B * 40e9 / (r["weight_bytes"] + r["kv_bytes_read_per_step"])
        assert math.isclose(r["bandwidth_bound_tokens_per_s"], bound)
        assert math.isclose(r["fraction_of_bound"], r["decode_tokens_per_s"] / bound)
        full = next(f for f in ok if f["policy"] == "full" and (f["batch_size"], f["context_length"], f["kv_bits"])
                    == (B, T, r["kv_bits"]))
        assert math.isclose(r["speedup_vs_full"], r["decode_tokens_per_s"] / full["decode_tokens_per_s"])
        assert r["decode_recompiles"] == 0
    probe = [r for r in ok if r["policy"] == "probe"]
    assert all(r["policy_args"] == "window=16" and r["policy_config"]["window"] == 16 for r in probe)
    assert all(r["speedup_vs_full"] == 1.0 for r in ok if r["policy"] == "full")
    # the reference policy runs first in every group
    assert [r["policy"] for r in ok if r["kv_bits"] == 16][:2] == ["full", "probe"]

    with open(out_csv) as f:
        table = list(csv.DictReader(f))
    header = next(csv.reader(open(out_csv)))
    assert header[:len(report.E2E_KEYS)] == report.E2E_KEYS
    assert "speedup_vs_full" in header and len(table) == len(rows)
    assert {t["policy"] for t in table} == {"full", "probe"}
    assert float(table[[r["status"] for r in rows].index("ok")]["decode_tokens_per_s"]) > 0
    pytest.importorskip("matplotlib")
    assert out_png.stat().st_size > 0


def test_storage_table_pivots_policies_by_storage(capsys):
    """The storage x policy table: one cell per measured (policy, storage), ratios over the policy's
    first storage and over full at the same storage, '-' where a row was not measured."""
    def row(policy, bits, tps, kv_dtype=None, status="ok"):
        return {"mode": "e2e", "status": status, "policy": policy, "kv_bits": bits, "kv_dtype": kv_dtype,
                "batch_size": 8, "context_length": 4096, "compile": False, "decode_tokens_per_s": tps}
    rows = [row("full", 32, 100.0), row("full", 16, 125.0, "bfloat16"), row("full", 4, 200.0),
            row("hshare", 32, 150.0), row("hshare", 16, None, status="skipped"), row("hshare", 4, 300.0)]
    report.print_storage_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert "B=8 ctx=4096 eager" in lines[0]
    assert lines[1].split() == ["policy", "fp32", "bfloat16", "kv4"]
    assert lines[2].split() == ["full", "100.0", "(1.00x,", "1.00x)", "125.0", "(1.25x,", "1.00x)",
                                "200.0", "(2.00x,", "1.00x)"]
    assert lines[3].split() == ["hshare", "150.0", "(1.00x,", "1.50x)", "-", "300.0", "(2.00x,", "1.50x)"]
    report.print_storage_table([r for r in rows if r["kv_bits"] == 32])      # one storage: no table
    assert capsys.readouterr().out == ""


def test_e2e_real_model_row(capsys, default_dir, tmp_path):
    """The end-to-end path on the real default model (the mechanics are tested on tiny_dir above):
    one full-cache row per storage, its header, byte accounting and roofline from the real shapes."""
    out_json = tmp_path / "b.json"
    rc, out, err = run(capsys, default_dir, "--policies", "full", "--batch-sizes", "2", "--context-lengths", "32",
                       "--kv-bits", "16,4", "--kv-residual", "32", "--json", str(out_json))
    assert rc == 0, err
    assert "# model SmolLM2-135M-Instruct: 30 layers, 9 q / 3 kv heads, head_dim 64, context 8192" in out
    rows = json.loads(out_json.read_text())
    assert [(r["status"], r["kv_bits"]) for r in rows] == [("ok", 16), ("ok", 4)]
    a = ModelArgs(49152, 576, 30, 9, 3, 1536)
    params = a.vocab_size * a.dim + a.dim + a.n_layers * (2 * a.dim * a.n_heads * a.head_dim   # tied output
                                                          + 2 * a.dim * a.n_kv_heads * a.head_dim
                                                          + 3 * a.dim * a.intermediate_size + 2 * a.dim)
    slot = per_slot_bytes(a)
    for r in rows:
        for key, kind in SCHEMA.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["mode"] == "e2e" and r["batch_size"] == 2 and r["context_length"] == 32 and r["decode_recompiles"] == 0
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["weight_bytes"] == 4 * params and r["peak_memory_bytes"] > r["weight_bytes"]
        assert math.isclose(r["bandwidth_bound_tokens_per_s"], 2 * 40e9 / (r["weight_bytes"] + r["kv_bytes_read_per_step"]))
    full16, full4 = rows
    assert full16["kv_bytes_allocated"] == 2 * slot * (32 + 1 + 4 + specs.CAPACITY_MARGIN)
    assert full16["kv_bytes_live"] == 2 * slot * (32 + 1 + 4)
    assert 0 < full4["kv_bytes_allocated"] < full16["kv_bytes_allocated"] and full4["policy_config"]["kv_bits"] == 4


def test_keyboard_interrupt_keeps_finished_rows(capsys, tiny_dir, tmp_path, monkeypatch):
    out_json, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    real, calls = grid.e2e_row, []

    def second_row_interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(grid, "e2e_row", second_row_interrupted)
    rc, out, err = run(capsys, tiny_dir, "--policies", "full", "--context-lengths", "32,40,48",
                       "--json", str(out_json), "--csv", str(out_csv))
    assert rc == 130
    assert "interrupted: kept 1 finished row(s)" in err
    rows = json.loads(out_json.read_text())
    assert len(rows) == 1 and rows[0]["context_length"] == 32 and rows[0]["status"] == "ok"
    assert len(list(csv.DictReader(open(out_csv)))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.csv", "b.json"]  # no tmp file left behind


def test_sigint_subprocess_keeps_rows(tiny_dir, tmp_path):
    """A real Ctrl-C (SIGINT) mid-run: exit status 130 and a valid JSON of the finished rows."""
    out_json = tmp_path / "b.json"
    p = subprocess.Popen([sys.executable, str(benchmark.ROOT / "scripts" / "benchmark.py"), "--checkpoint",
                          str(tiny_dir), *FAST, "--policies", "full", "--context-lengths",
                          ",".join(str(32 + i) for i in range(400)), "--json", str(out_json)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if out_json.exists() and len(json.loads(out_json.read_text())) >= 2:
                break
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    rows = json.loads(out_json.read_text())
    assert len(rows) >= 2 and all(r["status"] == "ok" for r in rows)
    assert f"kept {len(rows)} finished row(s)" in err


def test_atomic_write_replaces_whole_file(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old")
    moves = []
    real_replace = os.replace

    def spy(src, dst):
        moves.append((src, dst))
        assert target.read_text() == "old"  # the target is never written in place
        real_replace(src, dst)

    monkeypatch.setattr(report.os, "replace", spy)
    report.atomic_write(target, "[1, 2]\n")
    assert target.read_text() == "[1, 2]\n"
    (src, dst), = moves
    assert os.path.dirname(src) == str(tmp_path) and dst == target and not os.path.exists(src)


# --------------------------------------------------------------------------- other modes

def test_attention_operator_rows(capsys, default_dir, tmp_path):
    out_json = tmp_path / "a.json"
    rc, out, err = run(capsys, default_dir, "--op", "attention", "--policies", "full", "--batch-sizes", "2",
                       "--context-lengths", "32", "--op-iters", "3", "--json", str(out_json))
    assert rc == 0, err
    rows = json.loads(out_json.read_text())
    assert [r["policy"] for r in rows] == ["dense_sdpa", "full"]
    dense, full = rows
    assert all(r["mode"] == "attention" and r["status"] == "ok" and r["n_layers"] == 30 for r in rows)
    assert all(r["attention_us_per_layer"] > 0 and len(r["attention_us_samples"]) == 3 for r in rows)
    assert math.isclose(full["attention_ms_per_step"] * 1000 / 30, full["attention_us_per_layer"])
    assert dense["speedup_vs_dense_sdpa"] == 1.0
    assert math.isclose(full["speedup_vs_dense_sdpa"], dense["attention_us_per_layer"] / full["attention_us_per_layer"])
    slot = 2 * 3 * 64 * 4 * 30
    assert dense["kv_bytes_read_per_step"] == 2 * slot * 32
    assert full["kv_bytes_read_per_step"] == 2 * slot * 33  # the prompt + the captured real decode step
    assert "us/layer" in out and "dense_sdpa" in out


def test_sweep_context_rows_and_plot(capsys, tiny_dir, probe_policy, tmp_path):
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    rc, out, err = run(capsys, tiny_dir, "--sweep-context", "32:64", "--policies", "all",
                       "--json", str(out_json), "--plot", str(out_png))
    assert rc == 0, err
    rows = json.loads(out_json.read_text())
    registered = cache.policy_names()  # every registered policy, the test's probe included
    assert "probe" in registered
    assert {(r["policy"], r["context_length"]) for r in rows} == {(p, c) for p in registered for c in (32, 64)}
    assert all(r["mode"] == "sweep" and r["status"] == "ok" and r["decode_step_ms"] > 0 for r in rows)
    assert specs.parse_sweep("256:8192", 8192, 100) == [256, 512, 1024, 2048, 4096, 8092]
    assert specs.parse_sweep("100,300", 8192, 100) == [100, 300]
    pytest.importorskip("matplotlib")
    assert out_png.stat().st_size > 0


@pytest.fixture(scope="module")
def kv_tiny_dir(tmp_path_factory):
    """tiny_dir's model with the default model's KV bytes per token (30 layers x 3 KV heads x 64):
    the memory search needs several MB per sequence to stand out of the noise of the resident base
    it re-measures, and the layers are narrow, so it still runs ~10x fewer FLOPs per token."""
    from tests.conftest import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("kv_tiny") / "kv-tiny-llama", num_hidden_layers=30,
                                 num_attention_heads=3, num_key_value_heads=3)


@pytest.mark.model  # kv_tiny_dir copies the default model's tokenizer
def test_memory_limit_search_monotonic_and_verified(capsys, kv_tiny_dir, tmp_path):
    out_json = tmp_path / "m.json"
    rc, out, err = run(capsys, kv_tiny_dir, "--memory-limit", "1GiB,1.5GiB,2GiB,4GiB,16GiB", "--policies", "full",
                       "--context-lengths", "64", "--verify-seconds", "0", "--json", str(out_json))
    assert rc == 0, err
    rows = json.loads(out_json.read_text())
    assert [r["memory_limit_bytes"] for r in rows] == [int(x * 2**30) for x in (1, 1.5, 2, 4, 16)]
    batches = [r["max_batch_size"] for r in rows]
    assert batches == sorted(batches) and batches[-1] > batches[0]
    r = rows[-1]
    assert r["kv_bytes_allocated_per_seq"] == per_slot_bytes(dir_args(kv_tiny_dir)) * (64 + 4 + 16)
    assert r["state_bytes_per_seq"] >= r["kv_bytes_allocated_per_seq"]
    per = r["state_bytes_per_seq"] + r["workspace_bytes_per_seq"]
    fixed = r["base_bytes"] + r["state_bytes_fixed"] + r["workspace_bytes_fixed"]
    for row in rows:
        b = row["max_batch_size"]
        budget = row["memory_limit_bytes"] * 0.95
        assert b == row["model_batch_size"] and row["predicted_bytes"] == fixed + b * per
        assert fixed + b * per <= budget < fixed + (b + 1) * per or b == 0
        assert row["verified"] is None and row["verify_runs"] == [] and row["verify_note"]

    # a limit that fits exactly 3 sequences: run them and compare the real peak with the model
    limit = math.ceil((fixed + 3.5 * per) / 0.95)
    rc, out, err = run(capsys, kv_tiny_dir, "--memory-limit", str(limit), "--policies", "full",
                       "--context-lengths", "64", "--verify-seconds", "60", "--json", str(out_json))
    assert rc == 0, err
    (row,) = json.loads(out_json.read_text())
    assert row["model_batch_size"] in (2, 3, 4)  # the base is re-measured by this second run
    assert row["verified"] is True and row["verified_within_limit"] is True
    assert row["verified_batch_size"] == row["max_batch_size"] > 0
    runs = dict(row["verify_runs"])  # real runs: the model's batch first, then refits
    assert row["verify_runs"][0][0] == row["model_batch_size"] and 1 <= len(runs) <= 3
    assert runs[row["max_batch_size"]] == row["verified_peak_bytes"] <= limit
    assert all(b <= row["max_batch_size"] for b, peak in runs.items() if peak <= limit)
    assert abs(row["prediction_error"]) < 0.25


# --------------------------------------------------------------------------- errors and parsing

@pytest.mark.parametrize("argv, message", [
    (["--policies", "full;nope"], f"unknown policy 'nope'; available: {', '.join(cache.policy_names())}"),
    (["--policies", "full", "--policies", "nope"], "unknown policy 'nope'"),
    (["--policies", "full,nope"], "'full,nope' is not one spec: separate specs with ';' or repeat the flag"),
    (["--policies", "hshare@a,hshare@b"], "is not one spec: separate specs with ';'"),
    (["--policies", "hshare@a:ratios=1-1-1,hshare@b:ratios=1-1-1"], "is not one spec: separate specs with ';'"),
    (["--policies", " ; "], "--policies is empty"),
    (["--policies", "full:"], "nothing after ':'"),
    (["--policies", "full:window"], "malformed policy argument 'window': expected key=value"),
    (["--policies", "full:window=3"], "policy 'full' has no parameter(s) window"),
    (["--policies", "snapkv:window=8"], "parameter 'window' is now 'obs_window'"),
    (["--policies", "snapkv:budget=x"], "budget='x' is not a valid int"),
    (["--policies", "full; snapkv", "--policies", "full"], "'full' is listed twice"),
    (["--policies", "full", "--policy-args", "full:"], "--policy-args is no longer accepted: put each policy's "
                                                       "arguments in its --policies spec"),
    (["--speedup-vs", "nope"], "--speedup-vs: unknown policy 'nope'"),
    (["--policies", "snapkv:budget=64", "--speedup-vs", "snapkv:budget=32"], "give only its NAME[@LABEL]"),
    (["--kv-bits", "8"], "--kv-bits 8: use 32, 16, 4 or 2"),
    (["--batch-sizes", "1,x"], "--batch-sizes expects comma-separated integers"),
    (["--context-lengths", "0"], "--context-lengths expects positive integers"),
    (["--memory-limit", "8 parsecs"], "cannot parse memory size '8 parsecs'"),
    (["--decode-steps", "0"], "--decode-steps must be at least 1"),
    (["--compile-prefill"], "--compile-prefill needs --compile on or both"),
    (["--prefill-row", "0"], "--prefill-row must be at least 1 token"),
])
def test_cli_errors(capsys, tmp_path, argv, message):
    rc = benchmark.main(["--checkpoint", str(tmp_path / "no-model"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err, err


def test_bad_sweep_and_missing_checkpoint(capsys, default_dir, tmp_path):
    assert benchmark.main(["--checkpoint", str(tmp_path / "no-model"), "--policies", "full"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert benchmark.main(["--checkpoint", str(default_dir), "--sweep-context", "64:32"]) == 2
    assert "--sweep-context expects START:STOP[:FACTOR]" in capsys.readouterr().err


def test_context_beyond_the_model_is_an_error_row_not_a_crash(capsys, tiny_dir, tmp_path):
    out_json = tmp_path / "b.json"
    rc, out, err = run(capsys, tiny_dir, "--policies", "full", "--context-lengths", "32,8190",
                       "--json", str(out_json))
    rows = json.loads(out_json.read_text())
    assert rc == 1 and [r["status"] for r in rows] == ["ok", "error"]
    assert "exceeds the model's context length 8192" in rows[1]["error"]


def test_parsers_and_prompts():
    assert specs.parse_bytes("8GiB") == 8 << 30 and specs.parse_bytes("512MiB") == 512 << 20
    assert specs.parse_bytes("8GB") == 8 * 10**9 and specs.parse_bytes("1.5G") == 3 << 29
    a = specs.make_prompt(100, 2, 10, 0, "cpu", None)
    assert a.shape == (2, 10) and torch.equal(a, specs.make_prompt(100, 2, 10, 0, "cpu", None))
    assert not torch.equal(a[0], a[1])
    f = specs.make_prompt(100, 2, 7, 0, "cpu", [5, 6, 7])
    assert f.shape == (2, 7) and f[0].tolist() == [5, 6, 7, 5, 6, 7, 5] and f[1, 0].item() == [5, 6, 7][997 % 3]


def options(*argv):
    """The checked options of a command line (no model is loaded)."""
    o = cli.build_parser().parse_args(list(argv))
    cli.check_options(o)
    return o


def test_policy_spec_lists_one_syntax(capsys):
    """--policies takes cache/spec.py's lists: ';'-separated, the flag repeated, or both; 'all'
    expands in place; rows take policy (NAME@LABEL) and policy_args (the k=v text) from the spec."""
    text = "hshare@a:ratios=1/2-1/2-1/2; hshare@b:ratios=1-1-1;snapkv+ds:budget=64"
    semi = options("--policies", text).policy_list
    repeated = options("--policies", "hshare@a:ratios=1/2-1/2-1/2", "--policies", "hshare@b:ratios=1-1-1",
                       "--policies", "snapkv+ds:budget=64").policy_list
    mixed = options("--policies", "hshare@a:ratios=1/2-1/2-1/2; hshare@b:ratios=1-1-1",
                    "--policies", "snapkv+ds:budget=64").policy_list
    assert semi == repeated == mixed == cache.parse_spec_list(text)
    configs = [specs.Config(s, 16, False) for s in semi]
    assert [(c.policy, c.policy_args) for c in configs] == \
        [("hshare@a", "ratios=1/2-1/2-1/2"), ("hshare@b", "ratios=1-1-1"), ("snapkv+ds", "budget=64")]
    assert configs[0].label == "hshare@a(ratios=1/2-1/2-1/2)"
    assert [s.variant for s in options().policy_list] == cache.policy_names()  # the default: all
    assert [s.variant for s in options("--policies", "all; snapkv@small:budget=64").policy_list] == \
        cache.policy_names() + ["snapkv@small"]
    # --speedup-vs: the reference runs first; one not listed is added (a whole spec is allowed then)
    o = options("--policies", "snapkv:budget=64; full", "--speedup-vs", "full")
    assert [str(s) for s in o.policy_list] == ["full", "snapkv:budget=64"] and o.reference == "full"
    o = options("--policies", "full", "--speedup-vs", "snapkv@ref:budget=64")
    assert [str(s) for s in o.policy_list] == ["snapkv@ref:budget=64", "full"] and o.reference == "snapkv@ref"
    assert "added snapkv@ref:budget=64 to --policies" in capsys.readouterr().err
    # every configuration: specs x kv-bits x compile, in that order
    o = options("--policies", "full; tova:budget=64", "--kv-bits", "16,4", "--compile", "both")
    assert [(c.policy, c.kv_bits, c.compile) for c in specs.grid(o)][:4] == \
        [("full", 16, False), ("full", 16, True), ("full", 4, False), ("full", 4, True)]


# --------------------------------------------------------------------------- compiled decode

def test_compiled_decode_loop_never_recompiles():
    """The compiled path as the benchmark drives it (compiled_steps after warm-up): timed
    decode loops at the warm-up context and at longer contexts compile nothing new."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=128, dim=96, n_layers=2, n_heads=6, n_kv_heads=2, intermediate_size=96,
                     max_position_embeddings=256, tie_word_embeddings=True)
    model = Transformer(args).eval()
    meter = measure.MemoryMeter(torch.device("cpu"))
    cfg = specs.Config(PolicySpec("full"), 16, True)
    torch._dynamo.reset()
    counters.clear()
    tokens = torch.randint(0, 128, (2, 40))
    measure.warm_up(model, cfg, tokens[:, :24], 8, 2, 16, meter)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1  # the decode step (the prefill runs eager)
    for T in (24, 37, 40):  # prefill chunks of 16 (never a 1-token chunk: that is a decode-shaped call)
        s = measure.measure_e2e(model, cfg, tokens[:, :T], 8, 2, 16, meter)
        assert s["decode_recompiles"] == 0
    assert counters["stats"]["unique_graphs"] == compiled, "the compiled steps recompiled after warm-up"
    # and the compiled steps compute what eager does
    model.setup_caches(2, 64, FullCache())
    with torch.inference_mode():
        eager = measure.run_prefill(model, prefill_step, tokens[:, :37], 16)
    model.setup_caches(2, 64, FullCache())
    with torch.inference_mode():
        comp = measure.run_prefill(model, compiled_steps(torch.device("cpu"), prefill=True)[0], tokens[:, :37], 16)
    torch.testing.assert_close(comp, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.model  # copies the default model's config and tokenizer
def test_random_checkpoint_script(default_dir, tmp_path, capsys):
    """scripts/random_checkpoint.py: the config with --set applied, the tokenizer copied, no calibration
    files under --set (other shapes), a model that loads and decodes; bad input exits 2 with a message."""
    import random_checkpoint
    out = tmp_path / "rnd"
    assert random_checkpoint.main(["--like", str(default_dir), "--out", str(out), "--set", "num_hidden_layers=2",
                                   "--set", "hidden_size=128", "--set", "intermediate_size=256"]) == 0
    config = json.loads((out / "config.json").read_text())
    like = json.loads((default_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 128, like["vocab_size"])
    assert (out / "tokenizer.json").read_bytes() == (default_dir / "tokenizer.json").read_bytes()
    assert not (out / "heavy_channels.json").exists()
    model, tok = engine.load_model(out, "cpu", "float32")
    assert len(engine.generate(model, tok, ["Hello"], max_new_tokens=3).tokens[0]) == 3
    for argv, message in ((["--like", str(tmp_path), "--out", str(tmp_path / "x")], "no config.json"),
                          (["--like", str(default_dir), "--out", str(out)], "exists"),
                          (["--like", str(default_dir), "--out", str(tmp_path / "y"), "--set", "layers"], "FIELD=INT")):
        with pytest.raises(SystemExit) as e:
            random_checkpoint.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.model  # copies the default model's tokenizer
def test_random_checkpoint_of_a_config_without_weights(default_dir, tmp_path, capsys):
    """--like data/configs/llama-3.1-8b (a config.json only) --tokenizer DIR --dtype bfloat16: its untied output
    head written as lm_head.weight, bfloat16 weights, the tokenizer of DIR; without --tokenizer it says which
    directory lacks the tokenizer files."""
    import random_checkpoint
    from checkpoint import read_hf_dir
    from safetensors import safe_open
    like, out = Path(__file__).resolve().parent.parent / "data" / "configs" / "llama-3.1-8b", tmp_path / "rnd"
    small = ["--set", "num_hidden_layers=2", "--set", "hidden_size=128", "--set", "intermediate_size=256",
             "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "head_dim=32",
             "--set", "vocab_size=49152"]
    assert random_checkpoint.main(["--like", str(like), "--tokenizer", str(default_dir), "--dtype", "bfloat16",
                                   "--out", str(out), *small]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys() and f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    args, _ = read_hf_dir(out)
    assert not args.tie_word_embeddings and args.n_layers == 2 and args.rope_scaling
    assert (out / "tokenizer.json").read_bytes() == (default_dir / "tokenizer.json").read_bytes()
    with pytest.raises(SystemExit) as e:
        random_checkpoint.main(["--like", str(like), "--out", str(tmp_path / "x"), *small])
    assert e.value.code == 2 and "no tokenizer.json" in capsys.readouterr().err


@pytest.mark.model  # tiny_dir copies the default model's tokenizer
def test_compile_ab_script(tiny_dir, capsys):
    """scripts/compile_ab.py on the tiny model: the compiled step compiles, both steps alternate over one
    cache (rounds in both orders) and the ratios print; bad input exits 2 with a message, before loading."""
    import compile_ab
    assert compile_ab.main(["--checkpoint", str(tiny_dir), "--kv-bits", "4", "--batch-size", "2",
                            "--context-length", "40", "--rounds", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "compile + 4 steps" in out and out.count("round ") == 2 and "compiled / eager speed: median" in out
    for argv, message in ((["--checkpoint", "/nonexistent"], "not found"),
                          (["--checkpoint", str(tiny_dir), "--policy", "nosuch"], "--policy"),
                          (["--checkpoint", str(tiny_dir), "--policy", "pod", "--kv-bits", "4"], "--kv-bits 4"),
                          (["--checkpoint", str(tiny_dir), "--steps", "0"], "must be positive")):
        with pytest.raises(SystemExit) as e:
            compile_ab.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert compile_ab.main(["--checkpoint", str(tiny_dir), "--context-length", "100000"]) == 2
    assert "exceed the model's context" in capsys.readouterr().err
