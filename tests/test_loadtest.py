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


# --------------------------------------------------------------------------- peers: workloads, sides, offline

def test_crowd_and_long_gen_shapes():
    """crowd: 64 requests, 32 concurrent, each its own document; long-gen: 32 / 32, ~200-token prompts and
    512-1024 new tokens spread over the requests (D2O's Table 3 lengths), interleaved; --max-tokens overrides."""
    assert loadtest.WORKLOADS["crowd"] == (64, 32) and loadtest.WORKLOADS["long-gen"] == (32, 32)
    crowd = loadtest.workload("crowd", 64, 100)
    assert len(set(crowd)) == 64 and crowd[:3] == loadtest.workload("docs", 3, 100)
    assert loadtest.request_tokens("crowd", 64, None) == [128] * 64
    long_gen = loadtest.workload("long-gen", 32, None)
    assert len(set(long_gen)) == 32 and all(600 < len(p) < 1100 for p in long_gen)     # ~150-275 tokens
    n = loadtest.request_tokens("long-gen", 32, None)
    assert (min(n), max(n), len(set(n))) == (512, 1024, 32) and n != sorted(n)
    assert loadtest.request_tokens("long-gen", 5, 16) == [16] * 5
    assert loadtest.request_tokens("long-gen", 1, None) == [512]


def test_templated_prompts_are_the_chat_template_of_the_checkpoint(tiny_dir):
    (text,) = loadtest.templated(["Hello there"], tiny_dir)
    assert text.endswith("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"), text


@pytest.mark.parametrize("argv, message", [
    (["--offline", "--peer", "vllm"], "--offline runs ours through RowBatch"),
    (["--peer", "openvino"], "--peer openvino runs only with --offline"),
    (["--peer", "vllm"], "--vllm-python is needed for --peer vllm: install it with scripts/setup_peers.sh"),
    (["--peer", "llama-server", "--llama-server", "/nonexistent/llama-server"],
     "--llama-server /nonexistent/llama-server: no such file for --peer llama-server"),
    (["--offline", "--peer", "openvino", "--openvino-python", sys.executable],
     "--openvino-model is needed for --peer openvino"),
    (["--server", "x", "--max-batch", "0"], "must be at least 1"),
    ([], "give --url, --server, --peer or --offline"),
])
def test_arguments_are_checked_before_anything_starts(argv, message, capsys):
    assert loadtest.main(argv) == 2
    assert message in capsys.readouterr().err


def test_peer_command_lines():
    """Each server side's command line and environment carry the same knobs: threads, OMP_WAIT_POLICY, rows,
    row length, and KV memory in each side's unit."""
    sides = loadtest.sides
    knobs = sides.Knobs(threads=2, omp_wait_policy="passive", max_batch=8, max_seq_length=4096, max_new_tokens=1024,
                        kv_memory=2 * 2**30)
    cmd, env = sides.ours_command("ck", 9000, knobs, ["--max-batch", "4"], kv_memory_flag=True)
    assert cmd[1:] == [str(ROOT / "serve.py"), "--checkpoint", "ck", "--host", "127.0.0.1", "--port", "9000",
                       "--max-batch", "8", "--max-seq-length", "4096", "--max-new-tokens-limit", "1024",
                       "--omp-wait-policy", "inherit", "--kv-memory", "2048MiB", "--max-batch", "4"]
    assert (env["OMP_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == ("2", "PASSIVE")
    assert "--kv-memory" not in sides.ours_command("ck", 9000, knobs, [], kv_memory_flag=False)[0]
    cmd, env = sides.vllm_command(sys.executable, str(sides.DEFAULT_HF), 9001, knobs, [])
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--max-num-seqs") + 1] == "8"
    assert cmd[cmd.index("--max-model-len") + 1] == "4096" and cmd[cmd.index("--model") + 1] == str(sides.DEFAULT_HF)
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("2", "0-1", "2")
    cmd, env = sides.llama_server_command(sys.executable, "m.gguf", str(sides.DEFAULT_HF), 9002, knobs, ["--jinja"])
    per_token = 2 * 30 * 3 * 64 * 2                 # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V at 16 bits
    assert sides.kv_bytes_per_token(sides.DEFAULT_HF) == per_token
    assert cmd[1:] == ["-m", "m.gguf", "-t", "2", "-tb", "2", "-np", "8", "-c", str(2 * 2**30 // per_token),
                       "--host", "127.0.0.1", "--port", "9002", "--jinja"]
    no_kv = sides.Knobs(threads=1, omp_wait_policy="unset", max_batch=4, max_seq_length=1000)
    cmd, env = sides.llama_server_command(sys.executable, "m.gguf", str(sides.DEFAULT_HF), 9002, no_kv, [])
    assert cmd[cmd.index("-c") + 1] == "4000" and "OMP_WAIT_POLICY" not in env
    assert sides.ours_command("ck", 1, no_kv, [], True)[0][-3:] == ["128", "--omp-wait-policy", "default"]
    cmd, _ = sides.llama_cpp_command("m.gguf", 9003, no_kv, [])
    assert cmd[cmd.index("--n_threads") + 1] == "1" and cmd[cmd.index("--n_ctx") + 1] == "1000"


def test_sizes_budgets_and_missing_peers():
    sides = loadtest.sides
    assert sides.parse_size("4GiB") == sides.parse_size("4") == 4 * 2**30 and sides.parse_size("512MiB") == 2**29
    with pytest.raises(ValueError, match="give a size"):
        sides.parse_size("lots")
    with pytest.raises(ValueError, match="whole GiB for vllm"):
        sides.vllm_command(sys.executable, "hf", 1, sides.Knobs(kv_memory=3 * 2**29), [])
    with pytest.raises(FileNotFoundError, match="--vllm-python /no/python: no such file"):
        sides.vllm_command("/no/python", "hf", 1, sides.Knobs(), [])
    with pytest.raises(FileNotFoundError, match="--llama-server is needed"):
        sides.llama_server_command(None, "m.gguf", "hf", 1, sides.Knobs(), [])
    assert sides.ov_eviction(256) == (32, 224, 288)
    with pytest.raises(ValueError, match="multiple of 32"):
        sides.ov_eviction(100)


def test_drive_rows_answers_as_one_request_alone(tiny_dir):
    """The offline path (RowBatch, concurrency gate, greedy, staged admission): 5 requests, 3 in flight on 2 rows,
    each with its own max_tokens, give the tokens each gets alone on one row, in order, and time them."""
    import engine
    from cache import make_policy
    from runtime.rows import RowBatch
    model, tok = engine.load_model(str(tiny_dir))
    prompts = [tok.encode(p, add_special_tokens=False) for p in loadtest.workload("docs", 5, 30)]
    limits = [3, 6, 4, 5, 2]

    def batch(rows):
        return RowBatch(model, lambda: make_policy("full"), rows, 256, 8, prefill_chunk=16)
    got = loadtest.sides.drive_rows(batch(2), prompts, limits, 3, eos=set())
    for i, (p, n) in enumerate(zip(prompts, limits)):
        (alone,) = loadtest.sides.drive_rows(batch(1), [p], [n], 1, eos=set())
        assert got[i]["tokens"] == alone["tokens"] and got[i]["output_tokens"] == n, i
        assert got[i]["prompt_tokens"] == len(p) and 0 < got[i]["ttft"] == got[i]["chunk_times"][0]
        assert got[i]["chunk_times"] == sorted(got[i]["chunk_times"])
    answer = got[1]["tokens"]
    k = next((k for k in range(1, 6) if answer[k] not in answer[:k]), None)
    if k is not None:                               # a token first seen at k ends the answer there, not counted
        assert loadtest.sides.drive_rows(batch(2), prompts[1:2], [6], 1, {answer[k]})[0]["tokens"] == answer[:k]
    assert loadtest.sides.drive_rows(batch(2), prompts[1:2], [6], 1, {answer[0]})[0]["output_tokens"] == 0
    too_long = loadtest.sides.drive_rows(batch(2), [prompts[0] * 20], [4], 1, set())[0]
    assert not too_long["ok"] and "max_seq_length 256" in too_long["error"]


def test_offline_run_writes_rows_and_a_renderable_table(tiny_dir, tmp_path):
    """--offline: ours in a subprocess per policy through RowBatch; the JSON rows and the --results table (which
    scripts/reproduce.py renders)."""
    out, table_path = tmp_path / "rows.json", tmp_path / "table.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "scripts/loadtest.py", "--offline", "--server", str(tiny_dir),
                        "--offline-policies", "full; snapkv:budget=64", "--template", str(tiny_dir),
                        "--workload", "crowd", "--requests", "3", "--concurrency", "2", "--max-tokens", "4",
                        "--doc-tokens", "40", "--threads", "1", "--max-batch", "2", "--max-seq-length", "512",
                        "--omp-wait-policy", "unset", "--json", str(out), "--results", str(table_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [row["side"] for row in rows] == ["ours full", "ours snapkv:budget=64"]
    for row in rows:
        assert (row["ok"], row["errors"], row["workload"], row["concurrency"]) == (3, 0, "crowd", 2), row
        assert 3 <= row["output_tokens"] <= 12 and row["ttft_p50_s"] > 0 and row["omp_wait_policy"] == "unset"
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] > 3 * 40 // 2
    sys.path.insert(0, str(ROOT / "scripts"))
    import reproduce
    text = "\n".join(reproduce.render_table(json.loads(table_path.read_text())))
    assert "| ours snapkv:budget=64 | crowd | 3 / 0 |" in text and "--offline" in text


def test_offline_dtype_reaches_our_side(tiny_dir, monkeypatch):
    """--offline-dtype bfloat16: our offline side loads the checkpoint in that dtype (as serve.py --dtype), and
    runs its requests; without it, the checkpoint's own (None to load_model)."""
    import engine
    import torch
    sides = loadtest.sides
    args = loadtest.build_parser().parse_args(["--offline", "--server", str(tiny_dir), "--offline-dtype", "bfloat16",
                                               "--max-batch", "2", "--concurrency", "2", "--threads", "1"])
    sent = []
    monkeypatch.setattr(sides, "run_worker", lambda cmd, spec, env, timeout: sent.append(spec) or {"error": "x"})
    knobs = loadtest.knobs_of(args, [3, 3])
    loadtest.run_offline("ours full", {"kind": "ours", "policy": "full"}, args, knobs, ["a b c", "d e"], [3, 3])
    assert sent[0]["dtype"] == "bfloat16" and sent[0]["checkpoint"] == str(tiny_dir)
    loaded, real = [], engine.load_model
    monkeypatch.setattr(engine, "load_model", lambda path, **kw: loaded.append(kw.get("dtype")) or real(path, **kw))
    spec = {**sent[0], "max_seq_length": 256, "max_new_tokens": 3}
    out = sides.ours_offline(spec)
    assert loaded == [torch.bfloat16] and [r["output_tokens"] for r in out["results"]] == [3, 3], out
    sides.ours_offline({**spec, "dtype": None})
    assert loaded[-1] is None
    with pytest.raises(SystemExit):
        loadtest.build_parser().parse_args(["--offline", "--offline-dtype", "float16"])


FAKE_OV = '''"""A stand-in for openvino_genai (its ContinuousBatchingPipeline's step API): each step gives every running
request one token; what the pipeline was given is written to log.json beside this file."""
import enum, json, os


class GenerationStatus(enum.Enum):
    RUNNING = 0
    FINISHED = 1


class AggregationMode:
    NORM_SUM = "NORM_SUM"


class SchedulerConfig:
    pass


class GenerationConfig:
    pass


class CacheEvictionConfig:
    def __init__(self, *args):
        self.args = list(args)


class Out:
    def __init__(self, n):
        self.generated_ids = [7] * n


class Handle:
    def __init__(self, n):
        self.left, self.new = n, 0

    def can_read(self):
        return self.new > 0

    def read(self):
        n, self.new = self.new, 0
        return {0: Out(n)}

    def get_status(self):
        return GenerationStatus.RUNNING if self.left or self.new else GenerationStatus.FINISHED


class ContinuousBatchingPipeline:
    def __init__(self, path, sc, device, properties):
        self.sc, self.handles, self.most = sc, [], 0
        self.log = {"path": path, "device": device, "properties": properties, "cache_size": sc.cache_size,
                    "max_num_seqs": sc.max_num_seqs, "prompts": [], "configs": [],
                    "eviction": sc.cache_eviction_config.args if getattr(sc, "use_cache_eviction", False) else None}

    def add_request(self, i, prompt, config):
        self.log["prompts"].append(prompt)
        self.log["configs"].append([config.max_new_tokens, config.do_sample, config.apply_chat_template])
        self.handles.append(Handle(config.max_new_tokens))
        return self.handles[-1]

    def step(self):
        running = [h for h in self.handles if h.left][:self.sc.max_num_seqs]
        self.log["most_in_flight"] = max(self.log.get("most_in_flight", 0), len([h for h in self.handles if h.left]))
        for h in running:
            h.left, h.new = h.left - 1, h.new + 1
        with open(os.path.join(os.path.dirname(__file__), "log.json"), "w") as f:
            json.dump(self.log, f)
'''


def test_openvino_side_plumbing(tmp_path, monkeypatch):
    """--peer openvino's worker (scripts/ov_peer.py) against a stand-in openvino_genai: the scheduler gets the
    knobs (rows, cache GiB, threads, eviction at our policy's budget), each request its own max_new_tokens, greedy,
    no chat template of its own, at most `concurrency` in flight; every token comes back as a row."""
    (tmp_path / "openvino_genai.py").write_text(FAKE_OV)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = loadtest.build_parser().parse_args(["--offline", "--peer", "openvino", "--openvino-python", sys.executable,
                                               "--openvino-model", str(tmp_path), "--kv-memory", "2GiB",
                                               "--max-batch", "2", "--concurrency", "3"])
    assert [label for label, _ in loadtest.offline_sides(args)] == [
        "ours full", "ours snapkv:budget=256", "openvino", "openvino evict 256"]
    knobs = loadtest.knobs_of(args, [3, 5, 4, 2])
    what = dict(loadtest.offline_sides(args))["openvino evict 256"]
    row = loadtest.run_offline("openvino evict 256", what, args, knobs, ["a", "b", "c", "d"], [3, 5, 4, 2])
    assert (row["ok"], row["errors"], row["output_tokens"]) == (4, 0, 14), row
    assert row["ttft_p50_s"] > 0 and row["requests_per_s"] > 0
    log = json.loads((tmp_path / "log.json").read_text())
    assert (log["cache_size"], log["max_num_seqs"], log["eviction"]) == (2, 2, [32, 224, 288, "NORM_SUM"])
    assert log["properties"] == {"INFERENCE_NUM_THREADS": 2} and log["device"] == "CPU"
    assert log["prompts"] == ["a", "b", "c", "d"] and log["most_in_flight"] <= 3
    assert log["configs"] == [[3, False, False], [5, False, False], [4, False, False], [2, False, False]]
