"""Load test for any OpenAI-compatible server: a workload at a given concurrency, streamed, timed per token.

    python scripts/loadtest.py --url http://127.0.0.1:8000 --workload docs --requests 16 --concurrency 8
    python scripts/loadtest.py --server checkpoints/SmolLM2-135M-Instruct --server-flags "--policy snapkv:budget=256" \\
        --peer llama.cpp --workload one-doc --threads 2 --json out.json
    python scripts/loadtest.py --server checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf --peer vllm \\
        --vllm-python $PEERS/vllm/bin/python --peer llama-server --llama-server $PEERS/llama.cpp/llama-server \\
        --workload crowd --kv-memory 4GiB
    python scripts/loadtest.py --offline --offline-policies 'full; snapkv:budget=256' --peer openvino \\
        --openvino-python $PEERS/ov/bin/python --openvino-model $PEERS/ov/smollm2-fp32 --workload docs

Sides, run one after the other, never at once: `--url` (a server already running), `--server CHECKPOINT` (this
repository's serve.py on a free port with --server-flags), and `--peer` (repeatable): `llama.cpp` (llama-cpp-python's
server on --gguf; the `peers` extra), `vllm` (vLLM's CPU backend, `python -m vllm.entrypoints.openai.api_server`
from its own venv, --vllm-python, bfloat16, on the HF directory --hf), `llama-server` (llama.cpp's C++ server,
--llama-server, on --gguf).  With `--offline` nothing is served: the same workload runs in a subprocess through
our RowBatch for each of --offline-policies (the checkpoint: --server, else --gguf), and with `--peer openvino`
through OpenVINO GenAI (scripts/ov_peer.py in its venv, --openvino-python, on --openvino-model exported by
optimum-cli), with its full cache and with its cache eviction at the budget of each compressing policy.  The
peers are installed by scripts/setup_peers.sh (docs/serving.md, Peers).

Every side started gets the same --threads (OMP_NUM_THREADS; llama.cpp's threads; vLLM's OpenMP threads bound to
CPUs 0..T-1), the same OMP_WAIT_POLICY (--omp-wait-policy: active, passive or unset; default the environment's,
else active; ours runs it with `--omp-wait-policy inherit`), rows (--max-batch: ours --max-batch, vLLM
--max-num-seqs, llama-server -np, OpenVINO max_num_seqs), tokens per row (--max-seq-length) and, with --kv-memory,
the same KV memory where it has a knob for it (ours --kv-memory when serve.py has it; vLLM VLLM_CPU_KVCACHE_SPACE;
llama-server -c, that many 16-bit tokens; OpenVINO cache_size; not the in-process RowBatch, whose rows are sized
by --max-seq-length).  Every request is greedy (temperature 0) and streamed; with `--api templated` (default)
the script applies the chat template of --template (our tokenizer) itself and sends the text to /v1/completions,
so every side gets the same prompt text (`chat`: /v1/chat/completions, each server its own template).

Workloads (text from data/, cut to about --doc-tokens tokens at ~4 characters a token, on a word boundary;
default requests / concurrency / max tokens):
    docs      request i asks a question about its own document (essay i, ~1.5k tokens); 16 / 8 / 128
    one-doc   every request asks a different question about one document (~3k tokens): a shared prefix; 16 / 8 / 128
    crowd     docs with more clients than rows: 64 / 32 / 128
    long-gen  a short prompt (~200 tokens: an excerpt and a request for a long essay) and 512-1024 new tokens
              (spread evenly over the requests: the generation lengths of D2O's Table 3); 32 / 32
    short     request i is only question i (a dozen tokens): many small requests, for long runs (--rss); 16 / 8 / 128
--max-tokens N gives every request N.  Per side: requests/s, output tokens/s (usage's completion_tokens, else the
content chunks; sides stop at their own EOS, so compare both), prompt tokens (the same prompts give the same count
on every side with the same tokenizer), time to first token (from the request's sending, queueing included) and
inter-token latency (between content chunks) p50/p95, and failures (HTTP status or error event, the first kept).

Memory: each side's server resident set size (RSS) before the workload (after --warmup requests, not timed)
and after it, and its growth in %: read from /proc/PID/status for a server this script starts, else from the
`process_resident_memory_bytes` gauge of the server's /metrics (serve.py has it; absent: not reported).

    python scripts/loadtest.py --server checkpoints/SmolLM2-135M-Instruct --server-flags "--policy snapkv:budget=64" \\
        --workload short --requests 500 --concurrency 8 --max-tokens 8 --threads 1 --warmup 16
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))     # its sibling, also when imported as scripts.loadtest
import loadtest_sides as sides  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ESSAYS = ROOT / "data" / "paul_graham_essays"
DEFAULT_GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHARS_PER_TOKEN = 4
PEER_MISSING = ("error: --peer llama.cpp needs llama-cpp-python, which is not installed: pip install -e '.[peers]' "
                "(it builds llama.cpp from source, ~10 minutes; see the README)")
QUESTIONS = ["What is the main argument of the text?", "Summarize the text in three sentences.",
             "Which examples does the author give?", "What does the author recommend?",
             "What is the most surprising claim in the text?", "Who is the intended reader?",
             "What would a critic say about the text?", "List three facts stated in the text.",
             "What problem does the text describe?", "How does the text end?",
             "What is the tone of the text?", "Which claim has the weakest support?",
             "What does the title suggest?", "What does the author say about money?",
             "What does the author say about time?", "Give the text a new title."]


# --------------------------------------------------------------------------- workloads

def document(index: int, tokens: int) -> str:
    """About `tokens` tokens of essay `index` (cycling through data/paul_graham_essays), cut on a word boundary."""
    files = sorted(ESSAYS.glob("*.txt"))
    text = " ".join(files[index % len(files)].read_text(encoding="utf-8").split())
    while len(text) < tokens * CHARS_PER_TOKEN:          # a short essay continues with the next ones
        index += 1
        text += " " + " ".join(files[index % len(files)].read_text(encoding="utf-8").split())
    return text[:tokens * CHARS_PER_TOKEN].rsplit(" ", 1)[0]


WORKLOADS = {"docs": (16, 8), "one-doc": (16, 8), "crowd": (64, 32), "long-gen": (32, 32), "short": (16, 8)}
LONG_GEN_TOKENS = (512, 1024)           # new tokens of long-gen's requests, spread evenly
DEFAULT_MAX_TOKENS = 128


def workload(name: str, requests: int, doc_tokens: Optional[int]) -> list[str]:
    """The prompts: a document, then a question (the shared part first, so a server may reuse it)."""
    if name in ("docs", "crowd"):
        docs = [document(i, doc_tokens or 1500) for i in range(requests)]
    elif name == "one-doc":
        docs = [document(0, doc_tokens or 3000)] * requests
    elif name == "long-gen":
        return [f"Here is the start of an essay.\n\n{document(i, doc_tokens or 180)}\n\nWrite a long, detailed essay "
                f"that continues it, with examples, in at least 800 words." for i in range(requests)]
    elif name == "short":
        return [f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(requests)]
    else:
        raise ValueError(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
    return [f"Read the text below and answer the question.\n\n{doc}\n\nQuestion {i + 1}: "
            f"{QUESTIONS[i % len(QUESTIONS)]}" for i, doc in enumerate(docs)]


def request_tokens(name: str, requests: int, max_tokens: Optional[int]) -> list[int]:
    """max_tokens of each request: `max_tokens` if given, else long-gen's LONG_GEN_TOKENS spread evenly over the
    requests (interleaved, so long and short ones run together), else DEFAULT_MAX_TOKENS."""
    if max_tokens is not None:
        return [max_tokens] * requests
    if name != "long-gen":
        return [DEFAULT_MAX_TOKENS] * requests
    lo, hi = LONG_GEN_TOKENS
    spread = [lo + (hi - lo) * k // max(requests - 1, 1) for k in range(requests)]
    return [spread[(k * 7) % requests] if requests % 7 else spread[k] for k in range(requests)]


def templated(prompts: list[str], template_from) -> list[str]:
    """Each prompt as one user message, the chat template of `template_from` (a checkpoint: our tokenizer)
    applied with the generation prompt: the text every side gets with --api templated."""
    sys.path.insert(0, str(ROOT))
    from tokenizer import load_tokenizer
    tok = load_tokenizer(template_from)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]


# --------------------------------------------------------------------------- the client

@dataclass
class Result:
    """One request: times are seconds since it was sent."""
    ok: bool = False
    error: str = ""
    ttft: Optional[float] = None
    chunk_times: list = field(default_factory=list)      # arrival of each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0


def request_body(prompt: str, api: str, model: str, max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if api == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    """Send one streamed request and time its content chunks."""
    res, t0, chunks = Result(), time.perf_counter(), 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    res.error = f"error event: {json.dumps(event['error'])[:200]}"
                    return res
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if text:
                        chunks += 1
                        res.chunk_times.append(time.perf_counter() - t0)
                usage = event.get("usage") or {}
                res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.ok = True
    res.output_tokens = res.output_tokens or chunks
    res.ttft = res.chunk_times[0] if res.chunk_times else None
    return res


async def run_workload(url: str, prompts: list[str], concurrency: int, api: str, model: Optional[str],
                       max_tokens, extra: dict, timeout: float) -> tuple[list[Result], float]:
    """All prompts, at most `concurrency` in flight, max_tokens one for all or a list, one per prompt ->
    (results, wall seconds)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    # a fresh connection per request: llama-server closes idle kept-alive connections after 5 s, and a request
    # sent on one it just closed fails ("Server disconnected without sending a response")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt: str, n: int) -> Result:
            async with gate:
                return await one_request(client, path, request_body(prompt, api, model, n, extra))
        t0 = time.perf_counter()
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        results = await asyncio.gather(*(limited(p, n) for p, n in zip(prompts, limits)))
        return list(results), time.perf_counter() - t0


def percentile(xs: list[float], q: float) -> Optional[float]:
    """The q-quantile (0..1) of xs, linearly interpolated; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    at = q * (len(xs) - 1)
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def summarize(side: str, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {"side": side, "requests": len(results), "ok": len(ok), "errors": len(errors),
            "first_error": errors[0] if errors else None, "wall_s": wall,
            "requests_per_s": len(ok) / wall if wall else None, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall if wall else None,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95)}


def table(rows: list[dict]) -> str:
    cols = [("side", "side", "{}"), ("ok", "ok", "{}"), ("errors", "err", "{}"), ("wall_s", "wall s", "{:.1f}"),
            ("requests_per_s", "req/s", "{:.3f}"), ("output_tokens_per_s", "out tok/s", "{:.1f}"),
            ("ttft_p50_s", "TTFT p50", "{:.2f}"), ("ttft_p95_s", "TTFT p95", "{:.2f}"),
            ("itl_p50_s", "ITL p50 ms", "{:.1f}"), ("itl_p95_s", "ITL p95 ms", "{:.1f}"),
            ("rss_start_mib", "RSS start MiB", "{:.1f}"), ("rss_end_mib", "RSS end MiB", "{:.1f}"),
            ("rss_growth_pct", "RSS growth %", "{:+.2f}")]

    def cell(row, key, fmt):
        v = row.get(key)
        return "-" if v is None else fmt.format(v * 1000 if key.startswith("itl") else v)
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(lines + [f"{r['side']}: {r['first_error']}" for r in rows if r["first_error"]])


# --------------------------------------------------------------------------- servers this script starts

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(side: str, args, knobs: sides.Knobs, port: int) -> tuple[list[str], dict]:
    """(command line, environment) of a server this script starts: ours, llama.cpp, vllm or llama-server."""
    if side == "ours":
        kv = knobs.kv_memory is not None and serves_kv_memory()
        if knobs.kv_memory is not None and not kv:
            print("# ours: this serve.py has no --kv-memory; it runs without one", file=sys.stderr)
        return sides.ours_command(args.server, port, knobs, shlex.split(args.server_flags), kv)
    flags = shlex.split(args.peer_flags)
    if side == "llama.cpp":
        return sides.llama_cpp_command(args.gguf, port, knobs, flags)
    if side == "vllm":
        return sides.vllm_command(args.vllm_python, args.hf, port, knobs, flags)
    if side == "llama-server":
        return sides.llama_server_command(args.llama_server, args.gguf, args.hf, port, knobs, flags)
    raise ValueError(f"unknown server side {side!r}")


def serves_kv_memory() -> bool:
    """Whether this checkout's serve.py takes --kv-memory (its --help names it)."""
    r = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    return "--kv-memory" in r.stdout


class Started:
    """A server subprocess (its own process group) on a free port, ready once GET /v1/models answers 200 (vLLM
    and llama-server answer 503 or refuse while loading); the whole group stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, side: str, command: list[str], env: dict, port: int, startup_s: float):
        self.side, self.port = side, port
        self.log = tempfile.TemporaryFile("w+")      # not a pipe: a chatty server would fill it and block
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"the {side} server exited ({self.proc.returncode}): {tail}")
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"the {side} server did not answer /v1/models within {startup_s:.0f} s; its "
                                   f"output ended: {tail}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def tail(self, chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)        # what the server left behind in its group (workers)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


def rss_of(pid: int) -> Optional[int]:
    """Resident set size of process `pid` in bytes (VmRSS of Linux's /proc/PID/status); None where unreadable."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:")), None)


def rss_metric(url: str) -> Optional[int]:
    """The `process_resident_memory_bytes` gauge of the server's GET /metrics; None where it has none."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return next((int(float(line.split()[1])) for line in text.splitlines()
                 if line.startswith("process_resident_memory_bytes ")), None)


def memory(before: Optional[int], after: Optional[int]) -> dict:
    """RSS before and after the workload (MiB) and its growth (%); None where not measured."""
    if before is None or after is None:
        return {"rss_start_mib": None, "rss_end_mib": None, "rss_growth_pct": None}
    return {"rss_start_mib": before / 2**20, "rss_end_mib": after / 2**20, "rss_growth_pct": 100 * (after / before - 1)}


def run_side(side: str, args, knobs: sides.Knobs, prompts: list[str], max_tokens: list[int]) -> dict:
    """One served side's workload: against --url, or a server started (server_command) and stopped after;
    --warmup requests first (untimed), the server's RSS read before and after the workload."""
    server = None
    if side != "url":
        port = free_port()
        server = Started(side, *server_command(side, args, knobs, port), port, args.startup_timeout)
    url = server.url if server else args.url
    rss = (lambda: rss_of(server.proc.pid)) if server else (lambda: rss_metric(url))    # noqa: E731

    def run(n: int):
        return asyncio.run(run_workload(url, prompts[:n], args.concurrency, args.request_api, args.model,
                                        max_tokens[:n], json.loads(args.extra), args.timeout))
    try:
        if args.warmup:
            run(args.warmup)
        before = rss()
        results, wall = run(len(prompts))
        after = rss()
    finally:
        if server:
            server.stop()
    return {**summarize(side, results, wall), **memory(before, after)}


def offline_sides(args) -> list[tuple[str, dict]]:
    """(label, what to run) of each offline side: ours per --offline-policies, then OpenVINO GenAI (with --peer
    openvino) with its full cache and with eviction at each distinct budget of the compressing policies."""
    from cache import make_policy
    specs = [x.strip() for x in args.offline_policies.split(";") if x.strip()]
    out = [(f"ours {spec}", {"kind": "ours", "policy": spec}) for spec in specs]
    if "openvino" in args.peer:
        budgets = sorted({getattr(make_policy(spec), "budget", None) for spec in specs} - {None})
        out.append(("openvino", {"kind": "openvino", "eviction": None}))
        out += [(f"openvino evict {b}", {"kind": "openvino", "eviction": sides.ov_eviction(b)}) for b in budgets]
    return out


def run_offline(label: str, what: dict, args, knobs: sides.Knobs, prompts: list[str], max_tokens: list[int]) -> dict:
    """One offline side in its own process (ours: scripts/loadtest_sides.py; openvino: scripts/ov_peer.py in its
    venv) -> its row; a side that fails is a row with its error."""
    spec = {"prompts": prompts, "max_tokens": max_tokens, "concurrency": args.concurrency, "warmup": args.warmup,
            "threads": knobs.threads, "max_batch": knobs.max_batch, "max_seq_length": knobs.max_seq_length,
            "max_new_tokens": knobs.max_new_tokens}
    if what["kind"] == "ours":
        spec.update(checkpoint=args.server or args.gguf, policy=what["policy"], prefill_chunk=256, prefill_batch=4,
                    prefix_cache_mb=256, dtype=args.offline_dtype)          # (serve.py's defaults)
        cmd = [sys.executable, str(ROOT / "scripts" / "loadtest_sides.py")]
    else:
        spec.update(model_dir=args.openvino_model, eviction=what["eviction"], cache_gib=(
            sides.whole_gib(knobs.kv_memory, "openvino") if knobs.kv_memory is not None else 4))
        cmd = [str(args.openvino_python), str(ROOT / "scripts" / "ov_peer.py")]
    got = sides.run_worker(cmd, spec, sides.side_env(knobs), args.timeout * len(prompts))
    if "error" in got:
        results, wall = [Result(error=got["error"]) for _ in prompts], 0.0
    else:
        results = [Result(**{k: r.get(k) for k in ("ok", "error", "ttft", "chunk_times", "output_tokens",
                                                     "prompt_tokens") if r.get(k) is not None}) for r in got["results"]]
        wall = got["wall_s"]
    return {**summarize(label, results, wall), **memory(None, None)}


SERVER_PEERS = ("llama.cpp", "vllm", "llama-server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running OpenAI-compatible server (base URL, without /v1)")
    p.add_argument("--server", metavar="CHECKPOINT", help="start this repository's serve.py on CHECKPOINT "
                                                          "(--offline: the checkpoint our RowBatch runs)")
    p.add_argument("--server-flags", default="", help="more serve.py flags for --server, one string")
    p.add_argument("--peer", action="append", default=[], choices=[*SERVER_PEERS, "openvino"],
                   help="also run the workload on a peer (repeatable); openvino only with --offline")
    p.add_argument("--gguf", default=str(DEFAULT_GGUF), help="the GGUF file llama.cpp and llama-server serve")
    p.add_argument("--hf", default=str(sides.DEFAULT_HF), help="the HF directory vLLM serves (also its KV shape)")
    p.add_argument("--vllm-python", help="the python of vLLM's venv (scripts/setup_peers.sh: DIR/vllm/bin/python)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server (setup_peers.sh: DIR/llama.cpp/llama-server)")
    p.add_argument("--openvino-python", help="the python of OpenVINO GenAI's venv (setup_peers.sh: DIR/ov/bin/python)")
    p.add_argument("--openvino-model", help="the model exported by optimum-cli (setup_peers.sh: DIR/ov/smollm2-fp32)")
    p.add_argument("--peer-flags", default="", help="more flags for the peers' servers, one string")
    p.add_argument("--offline", action="store_true", help="no servers: ours through RowBatch, and --peer openvino")
    p.add_argument("--offline-policies", default="full; snapkv:budget=256", help="--offline: our policy specs")
    p.add_argument("--offline-dtype", choices=["float32", "bfloat16"],
                   help="--offline: the compute dtype of our side (as serve.py --dtype; default the checkpoint's: "
                        "float32 for a directory on the CPU)")
    p.add_argument("--workload", choices=list(WORKLOADS), default="docs")
    p.add_argument("--requests", type=int, help="default: the workload's (docs 16, crowd 64, long-gen 32)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: the workload's, 8 or 32)")
    p.add_argument("--warmup", type=int, default=0, help="requests (the workload's first) sent before the RSS is "
                                                         "read and the workload timed")
    p.add_argument("--max-tokens", type=int, help="new tokens of every request (default 128; long-gen 512-1024)")
    p.add_argument("--doc-tokens", type=int, help="document length in tokens (default: docs 1500, one-doc 3000, "
                                                  "long-gen's excerpt 180)")
    p.add_argument("--api", choices=["templated", "chat", "completions"], default="templated",
                   help="templated: --template's chat template applied here, sent to /v1/completions")
    p.add_argument("--template", default=str(sides.DEFAULT_HF), help="the checkpoint whose chat template --api "
                                                                     "templated applies")
    p.add_argument("--model", help="the model field of each request (default: the first of GET /v1/models)")
    p.add_argument("--extra", default="{}", help="JSON object merged into every request (e.g. an extension field)")
    p.add_argument("--threads", type=int, default=2, help="threads of each side this script starts")
    p.add_argument("--omp-wait-policy", choices=["active", "passive", "unset"],
                   default=(os.environ.get("OMP_WAIT_POLICY") or "active").lower(),
                   help="OMP_WAIT_POLICY of every side started (default: the environment's, else active)")
    p.add_argument("--max-batch", type=int, default=8, help="rows of every side started")
    p.add_argument("--max-seq-length", type=int, default=4096, help="tokens per row of every side started")
    p.add_argument("--kv-memory", help="KV memory of every side that has a knob for it, e.g. 4GiB (default: "
                                       "each side's own; vLLM's and OpenVINO's 4 GiB)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    p.add_argument("--startup-timeout", type=float, default=300, help="seconds a started server may take to answer")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': to stdout)")
    p.add_argument("--results", metavar="PATH", help="also write a table scripts/reproduce.py --render shows")
    return p


def check(args) -> str:
    """What is wrong with the arguments ('' when nothing)."""
    if args.omp_wait_policy not in ("active", "passive", "unset"):
        return f"OMP_WAIT_POLICY={args.omp_wait_policy!r}: use --omp-wait-policy active, passive or unset"
    if args.offline and (args.url or any(p in SERVER_PEERS for p in args.peer)):
        return "--offline runs ours through RowBatch and --peer openvino, no servers (--url, llama.cpp, vllm, " \
               "llama-server)"
    if "openvino" in args.peer and not args.offline:
        return "--peer openvino runs only with --offline (OpenVINO GenAI in process, no server)"
    if not (args.url or args.server or args.peer or args.offline):
        return "give --url, --server, --peer or --offline"
    if "llama.cpp" in args.peer and importlib.util.find_spec("llama_cpp") is None:
        return PEER_MISSING[len("error: "):]
    for flag, path, peer in (("--vllm-python", args.vllm_python, "vllm"), ("--llama-server", args.llama_server,
                              "llama-server"), ("--openvino-python", args.openvino_python, "openvino"),
                             ("--openvino-model", args.openvino_model, "openvino")):
        if peer in args.peer and not (path and Path(path).exists()):
            what = f"{flag} {path}: no such file" if path else f"{flag} is needed"
            return f"{what} for --peer {peer}: {sides.PEERS_DOC}"
    if min(args.requests, args.concurrency, args.max_tokens or 1, args.max_batch, args.threads) < 1 or args.warmup < 0:
        return "--requests, --concurrency, --max-tokens, --max-batch and --threads must be at least 1, --warmup " \
               "at least 0"
    return ""


def knobs_of(args, max_tokens: list[int]) -> sides.Knobs:
    return sides.Knobs(args.threads, args.omp_wait_policy, args.max_batch, args.max_seq_length, max(max_tokens),
                       None if args.kv_memory is None else sides.parse_size(args.kv_memory))


def machine_text(args) -> str:
    """The CPU, its cores, and what every side was given (for --results)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return (f"{cpu}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at the start; every side "
            f"{args.threads} threads, OMP_WAIT_POLICY {args.omp_wait_policy}, {args.max_batch} rows of "
            f"{args.max_seq_length} tokens, KV memory {args.kv_memory or 'each side its own'}")


def results_table(args, rows: list[dict], argv: list[str]) -> dict:
    """The rows as a table of results/ (scripts/reproduce.py renders it under section 16)."""
    columns = ["side", "workload", "ok / failed", "req/s", "output tok/s", "TTFT p50 s", "TTFT p95 s",
               "prompt tokens", "output tokens"]

    def num(v, fmt):
        return "-" if v is None else fmt.format(v)
    return {"topic": f"loadtest_{args.workload}{'_offline' if args.offline else ''}",
            "section": "16. Serving under load", "order": 5,
            "title": f"{'Offline' if args.offline else 'Served'} peers, {args.workload}: {rows[0]['requests']} "
                     f"requests, {rows[0]['concurrency']} concurrent, {rows[0]['max_tokens']} new tokens",
            "command": ["python scripts/loadtest.py " + " ".join(shlex.quote(a) for a in argv)],
            "date": time.strftime("%Y-%m-%d"), "machine": {"recorded": machine_text(args)}, "columns": columns,
            "rows": [[r["side"], r["workload"], f"{r['ok']} / {r['errors']}", num(r["requests_per_s"], "{:.3f}"),
                      num(r["output_tokens_per_s"], "{:.1f}"), num(r["ttft_p50_s"], "{:.2f}"),
                      num(r["ttft_p95_s"], "{:.2f}"), r["prompt_tokens"], r["output_tokens"]] for r in rows],
            "notes": "Greedy; sides stop at their own EOS, so compare requests/s with output tokens/s."}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    default_requests, default_concurrency = WORKLOADS[args.workload]
    args.requests = default_requests if args.requests is None else args.requests
    args.concurrency = default_concurrency if args.concurrency is None else args.concurrency
    problem = check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # stop the started servers on the way out
    prompts = workload(args.workload, args.requests, args.doc_tokens)
    max_tokens = request_tokens(args.workload, args.requests, args.max_tokens)
    args.request_api = "completions" if args.api == "templated" else args.api
    try:
        knobs = knobs_of(args, max_tokens)
        if args.api == "templated" or args.offline:
            prompts = templated(prompts, args.template)
        rows = []
        if args.offline:
            for label, what in offline_sides(args):
                rows.append(run_offline(label, what, args, knobs, prompts, max_tokens))
        else:
            for side in (["url"] if args.url else []) + (["ours"] if args.server else []) + args.peer:
                rows.append(run_side(side, args, knobs, prompts, max_tokens))
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    span = f"{min(max_tokens)}-{max(max_tokens)}" if min(max_tokens) < max(max_tokens) else max_tokens[0]
    rows = [{**r, "workload": args.workload, "concurrency": args.concurrency, "max_tokens": span,
             "threads": args.threads, "omp_wait_policy": args.omp_wait_policy, "max_batch": args.max_batch,
             "kv_memory": args.kv_memory} for r in rows]
    print(table(rows), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.results:
        Path(args.results).write_text(json.dumps(results_table(args, rows, argv), indent=1) + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
