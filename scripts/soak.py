"""Soak test for serve.py: many requests from clients that misbehave, then the server's memory and accounting.

    python scripts/soak.py --server checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf --requests 1000
    python scripts/soak.py --url http://127.0.0.1:8000 --requests 1000 --json soak.json

Request i is of kind KINDS[i % len(KINDS)], sent by --concurrency client threads at once (more than the server's
rows, so some wait in its queue): `ok` (a completion), `chat` (a chat completion), `stream` (a streamed chat
with include_usage, read to [DONE]), `timeout` (a completion whose client gives up after 0.05-0.5 s, often while
it waits for a row), `disconnect` (a streamed completion closed after its first event), `bad` (invalid input:
400) and `big` (a body one byte over the server's --max-body-bytes: 413).  After the first --warmup requests
and at the end (once the server has no request left) it reads the server's RSS (`process_resident_memory_bytes`
of /metrics, or /proc of a server it starts) and checks:

- RSS grew at most --rss-limit % from the warm-up point to the end;
- /metrics accounts for every request sent: the `kvserve_http_requests_total` counts added up to the requests
  sent, 200s = requests finished (stop, length), 499s = requests cancelled, 5xx = requests failed;
- the server ends idle (no row in use, nothing queued).
Exit status 0 when every check passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]      # the repository, and loadtest's own imports (as a script)
from loadtest import Started, free_port, rss_metric, rss_of  # noqa: E402
from loadtest_sides import Knobs, ours_command  # noqa: E402

KINDS = ("ok", "timeout", "stream", "bad", "disconnect", "chat", "timeout", "ok", "big", "disconnect")
BAD = [b"{not json", {"prompt": ""}, {"prompt": "hi", "frobnicate": 1}, {"prompt": "hi", "max_tokens": 0},
       {"messages": [{"role": "wizard", "content": "hi"}]}, {"messages": [{"role": "user"}]}]


def send(client: httpx.Client, kind: str, i: int, max_tokens: int, body_limit: int, rng: random.Random):
    """Request i of `kind` -> the HTTP status the client saw ("timeout" / "closed" where it saw none, the error's
    type where the connection failed)."""
    try:
        return request(client, kind, i, max_tokens, body_limit, rng)
    except httpx.HTTPError as e:
        return type(e).__name__


def request(client: httpx.Client, kind: str, i: int, max_tokens: int, body_limit: int, rng: random.Random):
    prompt = f"Request {i}: tell me about the number {i}."
    if kind in ("ok", "timeout"):
        body = {"prompt": prompt, "max_tokens": max_tokens * (8 if kind == "timeout" else 1), "temperature": 0}
        try:
            timeout = rng.uniform(0.05, 0.5) if kind == "timeout" else 120
            return client.post("/v1/completions", json=body, timeout=timeout).status_code
        except httpx.TimeoutException:
            return "timeout"
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.7}
        return client.post("/v1/chat/completions", json=body).status_code
    if kind in ("stream", "disconnect"):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens * 4, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if kind == "disconnect" and line.startswith("data: "):
                    return "closed"                 # (closing the response closes its connection)
                if line == "data: [DONE]":
                    break
            return r.status_code
    if kind == "bad":
        bad = BAD[i % len(BAD)]
        r = client.post("/v1/completions" if "prompt" in bad or isinstance(bad, bytes) else "/v1/chat/completions",
                        **({"content": bad} if isinstance(bad, bytes) else {"json": bad}))
        return r.status_code
    assert kind == "big", kind
    return client.post("/v1/completions", content=b"x" * (body_limit + 1),
                       headers={"content-type": "application/json"}).status_code


def http_counts(url: str) -> Counter:
    """The counters soak checks, from GET /metrics: ("http", status) and ("finished", reason) -> value."""
    out = Counter()
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, rest = line.partition("{")
        if name in ("kvserve_http_requests_total", "kvserve_requests_finished_total"):
            labels = dict(kv.split("=", 1) for kv in rest.rsplit("}", 1)[0].split(","))
            key = ("http", labels["status"].strip('"')) if "status" in labels else \
                ("finished", labels["reason"].strip('"'))
            out[key] += float(line.rsplit(" ", 1)[1])
    return out


def settle(url: str, seconds: float = 60) -> dict:
    """Wait until the server holds no request (its clients gone) -> its /health."""
    deadline = time.monotonic() + seconds
    while True:
        health = httpx.get(url + "/health", timeout=30).json()
        busy = health["rows_in_use"] + health["queue_depth"] + sum(p["prefilling"] for p in health["policies"].values())
        if not busy or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def soak(url: str, requests: int = 1000, concurrency: int = 16, max_tokens: int = 8, warmup: int = 100,
         seed: int = 0, rss: Optional[Callable[[], Optional[int]]] = None) -> dict:
    """Send the requests (the first `warmup` of them before the RSS reading that starts the measure) ->
    the report: what the clients saw, the /metrics deltas, the RSS and the checks' failures."""
    rss = rss or (lambda: rss_metric(url))
    body_limit = httpx.get(url + "/health", timeout=30).json()["max_body_bytes"]
    rng = random.Random(seed)
    seen, marks = Counter(), {}
    before = http_counts(url)
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=url, timeout=120, limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        for lo, hi in ((0, min(warmup, requests)), (min(warmup, requests), requests)):
            jobs = [pool.submit(send, client, KINDS[i % len(KINDS)], i, max_tokens, body_limit,
                                random.Random(rng.random())) for i in range(lo, hi)]
            for i, job in zip(range(lo, hi), jobs):
                seen[KINDS[i % len(KINDS)], str(job.result())] += 1
            settle(url)
            marks["warm" if lo == 0 else "end"] = rss()
    wall = time.monotonic() - t0
    health = settle(url)
    delta = http_counts(url) - before
    report = {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens, "warmup": warmup,
              "wall_s": round(wall, 1), "seen": {f"{k}:{s}": n for (k, s), n in sorted(seen.items())},
              "http": {s: int(n) for (kind, s), n in sorted(delta.items()) if kind == "http"},
              "finished": {r: int(n) for (kind, r), n in sorted(delta.items()) if kind == "finished"},
              "rss_warm_mib": marks["warm"] and marks["warm"] / 2**20,
              "rss_end_mib": marks["end"] and marks["end"] / 2**20,
              "idle_at_end": health["rows_in_use"] == 0 and health["queue_depth"] == 0}
    report["rss_growth_pct"] = (100 * (marks["end"] / marks["warm"] - 1) if marks["warm"] and marks["end"] else None)
    return report


def failures(report: dict, rss_limit_pct: Optional[float] = 5.0) -> list[str]:
    """The checks soak's report fails (empty: all pass); rss_limit_pct None: RSS not checked."""
    http, done, out = Counter(report["http"]), Counter(report["finished"]), []
    if sum(http.values()) != report["requests"]:
        out.append(f"/metrics counted {sum(http.values())} requests, {report['requests']} were sent: {dict(http)}")
    if http["200"] != done["stop"] + done["length"]:
        out.append(f"200s ({http['200']}) != requests finished ({done['stop'] + done['length']})")
    if http["499"] != done["cancelled"]:
        out.append(f"499s ({http['499']}) != requests cancelled ({done['cancelled']})")
    if http["500"] + http["503"] != done["error"]:
        out.append(f"5xx ({http['500'] + http['503']}) != requests failed ({done['error']})")
    if not report["idle_at_end"]:
        out.append("the server still holds requests at the end")
    growth = report["rss_growth_pct"]
    if rss_limit_pct is not None and (growth is None or growth > rss_limit_pct):
        out.append(f"RSS grew {growth}% from the warm-up point to the end (limit {rss_limit_pct}%)")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--url", help="a server already running (http://HOST:PORT)")
    side.add_argument("--server", metavar="CHECKPOINT", help="start serve.py on this checkpoint (a free port)")
    p.add_argument("--server-flags", default="--max-batch 8 --max-queue 16", help="serve.py's flags with --server")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of a server it starts")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds a server it starts may take")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16, help="client threads (more than the server's rows)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of a request (a timeout's: 8 times it)")
    p.add_argument("--warmup", type=int, default=100, help="requests before the RSS reading the growth starts from")
    p.add_argument("--rss-limit", type=float, default=5.0, help="the RSS growth allowed, in %%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report there")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    server = None
    if args.server:                             # serve.py as scripts/loadtest.py starts it, --server-flags last
        port = free_port()
        knobs = Knobs(threads=args.threads, omp_wait_policy=(os.environ.get("OMP_WAIT_POLICY") or "unset").lower())
        server = Started("ours", *ours_command(args.server, port, knobs, shlex.split(args.server_flags), False), port,
                         args.startup_timeout)
    try:
        url = server.url if server else args.url
        rss = (lambda: rss_of(server.proc.pid)) if server else None          # noqa: E731
        report = soak(url, args.requests, args.concurrency, args.max_tokens, args.warmup, args.seed, rss)
    finally:
        if server:
            server.stop()
    report["failures"] = failures(report, args.rss_limit)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
