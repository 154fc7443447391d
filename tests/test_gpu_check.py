"""scripts/gpu_check.sh (the GPU run in one call) and scripts/gpu_peers.py, as far as a machine without CUDA goes:
the dry run (every step up to the first CUDA call) and the refusal without the gpu/ folder it carries."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE_GPT_FAST = '''from dataclasses import dataclass
from typing import Optional

@dataclass
class ModelArgs:            # the fields gpt-fast's model.ModelArgs has (a stand-in: gpt-fast is never committed)
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = None


class Transformer:          # built only after the dry run stops
    pass
'''


def gpu_dir(tmp_path: Path) -> Path:
    """A stand-in for the gpu/ folder --fetch fills: gpt-fast's three files, the default config and tokenizer."""
    d = tmp_path / "gpu"
    (d / "gpt-fast").mkdir(parents=True)
    (d / "smollm2").mkdir()
    (d / "gpt-fast" / "model.py").write_text(FAKE_GPT_FAST)
    for f in ("generate.py", "tokenizer.py"):
        (d / "gpt-fast" / f).write_text("raise ImportError('not for a dry run')\n")
    config = json.loads((ROOT / "data/configs/llama-3.1-8b/config.json").read_text())
    config.update(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=49152, head_dim=64, rope_scaling=None, tie_word_embeddings=True)
    (d / "smollm2" / "config.json").write_text(json.dumps(config))
    (d / "smollm2" / "tokenizer.json").write_text("{}")
    return d


def run_check(*args, gpu: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_DIR": str(gpu), "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_dry_run_stops_before_cuda_and_prints_every_step(tmp_path):
    r = run_check("--dry-run", "--parts", "tests,small,large,policies,table3,kivi", gpu=gpu_dir(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tests collected" in r.stdout
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {(row["side"], row["config"].split("/")[-2]) for row in rows} == {
        ("gpt-fast", "smollm2"), ("hf", "smollm2"), ("gpt-fast", "llama-3.1-8b"), ("hf", "llama-3.1-8b")}
    assert all("dry_run" in row and "error" not in row for row in rows), rows
    assert "32 layers, dim 4096, 8 KV heads" in r.stdout
    steps = [line.split(":")[0][3:] for line in r.stdout.splitlines() if line.startswith("== ")]
    assert steps == ["tests", "small-checkpoint", "small-ours", "small-peers", "large-checkpoint", "large-ours",
                     "large-peers", "policies", "table3-full", "table3-compressed", "kivi"]
    assert "stopped before the first CUDA call" in r.stdout
    assert not list((ROOT / "results").glob("gpu_*.json.tmp*"))


def test_without_the_gpu_folder_it_says_to_fetch(tmp_path):
    r = run_check("--dry-run", gpu=tmp_path / "absent")
    assert r.returncode == 2 and "--fetch" in r.stderr


def test_an_unknown_argument_is_refused(tmp_path):
    r = run_check("--bogus", gpu=gpu_dir(tmp_path))
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr


def test_summary_reads_benchmark_and_peer_rows(tmp_path):
    ours = [{"policy": "full", "compile": True, "kv_bits": 16, "batch_size": 1, "context_length": 4096,
             "decode_tokens_per_s": 512.5, "static_decode_steps": 128}]
    peers = [{"side": "gpt-fast", "batch_size": 1, "context_length": 4096, "decode_tokens_per_s": 480.0},
             {"side": "hf", "error": "ImportError: no transformers"}]
    (tmp_path / "gpu_a.json").write_text(json.dumps(ours))
    (tmp_path / "gpu_peers_a.json").write_text(json.dumps(peers))
    out = subprocess.run([sys.executable, "scripts/gpu_peers.py", "--summary", str(tmp_path / "gpu_*.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    lines = out.splitlines()
    assert any("ours full compiled" in x and "512.5" in x and "128" in x for x in lines), out
    assert any("gpt-fast" in x and "480.0" in x for x in lines), out
    assert any("hf" in x and "ImportError" in x for x in lines), out
