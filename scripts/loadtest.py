"""Load test for any OpenAI-compatible server: a workload at a given concurrency, streamed, timed per token.

    python scripts/loadtest.py --url http://127.0.0.1:8000 --workload docs --requests 16 --concurrency 8
    python scripts/loadtest.py --server checkpoints/SmolLM2-135M-Instruct --server-flags "--policy snapkv:budget=256" \\
        --peer llama.cpp --workload one-doc --threads 2 --json out.json

Sides: `--url` (a server already running), `--server CHECKPOINT` (starts this repository's serve.py on a free
port with --server-flags, and stops it after), `--peer llama.cpp` (starts llama-cpp-python's own server,
`python -m llama_cpp.server`, on --gguf; needs the `peers` extra).  The sides run one after the other, never
at once, each with --threads threads (OMP_NUM_THREADS; llama.cpp's n_threads and n_threads_batch) and the
environment's OMP_WAIT_POLICY (ACTIVE unless set).

Workloads (text from data/, cut to about --doc-tokens tokens at ~4 characters a token, on a word boundary):
    docs      request i asks a question about its own document (essay i of data/paul_graham_essays, ~1.5k tokens)
    one-doc   every request asks a different question about one document (~3k tokens): a shared prefix
    short     request i is only question i (a dozen tokens): many small requests, for long runs (--rss)
Every request streams (`stream: true`, usage asked for) with temperature 0.  Per side: requests/s, output
tokens/s (usage's completion_tokens, else the content chunks), time to first token and inter-token latency
(between content chunks) p50/p95, and errors (HTTP status or error event, the first message kept).

Memory: each side's server resident set size (RSS) before the workload (after --warmup requests, not timed)
and after it, and its growth in %: read from /proc/PID/status for a server this script starts, else from the
`process_resident_memory_bytes` gauge of the server's /metrics (serve.py has it; absent: not reported).

    python scripts/loadtest.py --server checkpoints/SmolLM2-135M-Instruct --server-flags "--policy snapkv:budget=64" \
        --workload short --requests 500 --concurrency 8 --max-tokens 8 --threads 1 --warmup 16
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

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


def workload(name: str, requests: int, doc_tokens: Optional[int]) -> list[str]:
    """The prompts: a document, then a question (the shared part first, so a server may reuse it)."""
    if name == "docs":
        docs = [document(i, doc_tokens or 1500) for i in range(requests)]
    elif name == "one-doc":
        docs = [document(0, doc_tokens or 3000)] * requests
    elif name == "short":
        return [f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(requests)]
    else:
        raise ValueError(f"unknown workload {name!r}: docs, one-doc or short")
    return [f"Read the text below and answer the question.\n\n{doc}\n\nQuestion {i + 1}: "
            f"{QUESTIONS[i % len(QUESTIONS)]}" for i, doc in enumerate(docs)]


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
                       max_tokens: int, extra: dict, timeout: float) -> tuple[list[Result], float]:
    """All prompts, at most `concurrency` in flight -> (results, wall seconds)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt: str) -> Result:
            async with gate:
                return await one_request(client, path, request_body(prompt, api, model, max_tokens, extra))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
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
            "first_error": errors[0] if errors else None, "wall_s": wall, "requests_per_s": len(ok) / wall,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
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


def server_command(kind: str, target: str, port: int, threads: int, flags: str) -> list[str]:
    """The command line of a server to start: ours (serve.py on a checkpoint) or llama.cpp's (on a GGUF)."""
    if kind == "ours":
        return [sys.executable, str(ROOT / "serve.py"), "--checkpoint", target, "--port", str(port), *shlex.split(flags)]
    return [sys.executable, "-m", "llama_cpp.server", "--model", target, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
            "--interrupt_requests", "False",     # its default cuts a streaming request short when the next arrives
            *shlex.split(flags)]


class Started:
    """A server subprocess on a free port, ready once GET /v1/models answers; stopped (SIGTERM) on exit."""

    def __init__(self, kind: str, target: str, threads: int, flags: str, startup_s: float):
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env.setdefault("OMP_WAIT_POLICY", "ACTIVE")
        self.log = tempfile.TemporaryFile("w+")      # not a pipe: a chatty server would fill it and block
        self.proc = subprocess.Popen(server_command(kind, target, self.port, threads, flags), cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read()[-2000:].strip()
                self.log.close()
                raise RuntimeError(f"the {kind} server exited ({self.proc.returncode}): {tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {kind} server did not answer /v1/models within {startup_s:.0f} s")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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


def run_side(side: str, url: Optional[str], started: Optional[tuple], args, prompts: list[str]) -> dict:
    """One side's workload: against `url`, or a server started from (kind, target, flags) and stopped after;
    --warmup requests first (untimed), the server's RSS read before and after the workload."""
    server = Started(*started[:2], args.threads, started[2], args.startup_timeout) if started else None
    url = server.url if server else url
    rss = (lambda: rss_of(server.proc.pid)) if server else (lambda: rss_metric(url))    # noqa: E731

    def run(batch: list[str]):
        return asyncio.run(run_workload(url, batch, args.concurrency, args.api, args.model, args.max_tokens,
                                        json.loads(args.extra), args.timeout))
    try:
        if args.warmup:
            run(prompts[:args.warmup])
        before = rss()
        results, wall = run(prompts)
        after = rss()
    finally:
        if server:
            server.stop()
    return {**summarize(side, results, wall), **memory(before, after)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running OpenAI-compatible server (base URL, without /v1)")
    p.add_argument("--server", metavar="CHECKPOINT", help="start this repository's serve.py on CHECKPOINT")
    p.add_argument("--server-flags", default="", help="more serve.py flags for --server, one string")
    p.add_argument("--peer", choices=["llama.cpp"], help="also start llama-cpp-python's server and run the same workload")
    p.add_argument("--gguf", default=str(DEFAULT_GGUF), help="the GGUF file the llama.cpp peer serves")
    p.add_argument("--peer-flags", default="", help="more llama_cpp.server flags, one string")
    p.add_argument("--workload", choices=["docs", "one-doc", "short"], default="docs")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=0, help="requests (the workload's first) sent before the RSS is "
                                                         "read and the workload timed")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--doc-tokens", type=int, help="document length in tokens (default: docs 1500, one-doc 3000)")
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--model", help="the model field of each request (default: the first of GET /v1/models)")
    p.add_argument("--extra", default="{}", help="JSON object merged into every request (e.g. an extension field)")
    p.add_argument("--threads", type=int, default=2, help="threads of each server this script starts")
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    p.add_argument("--startup-timeout", type=float, default=300, help="seconds a started server may take to answer")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': to stdout)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.url or args.server or args.peer):
        print("error: give --url, --server or --peer", file=sys.stderr)
        return 2
    if args.peer and importlib.util.find_spec("llama_cpp") is None:
        print(PEER_MISSING, file=sys.stderr)
        return 2
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.warmup < 0:
        print("error: --requests, --concurrency and --max-tokens must be at least 1, --warmup at least 0",
              file=sys.stderr)
        return 2
    prompts = workload(args.workload, args.requests, args.doc_tokens)
    sides = ([("url", args.url, None)] if args.url else []) + \
            ([("ours", None, ("ours", args.server, args.server_flags))] if args.server else []) + \
            ([("llama.cpp", None, ("llama.cpp", args.gguf, args.peer_flags))] if args.peer else [])
    rows = []
    try:
        for side, url, started in sides:
            rows.append({**run_side(side, url, started, args, prompts), "workload": args.workload,
                         "concurrency": args.concurrency, "max_tokens": args.max_tokens})
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(table(rows), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
