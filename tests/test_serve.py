"""serve.py on the tiny random checkpoint: a real uvicorn server on a free 127.0.0.1 port, driven over HTTP."""
import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx  # the test extra pins the server's extra (starlette, uvicorn) and httpx
import pytest
import torch
import uvicorn

import engine
from runtime.context import prefill_context
from runtime.prefix_cache import common_prefix
from runtime.steps import Sampler
from server import loop
from server.app import app_options, build_engine, build_parser, make_app
from cache import make_policy

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def running(checkpoint, *flags):
    """A server for the flags on a free port -> (httpx client, its Engine); always shut down."""
    args = build_parser().parse_args(["--checkpoint", str(checkpoint), *flags])
    srv = build_engine(args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(srv, "tiny", **app_options(args)), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    srv.thread.start()
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=30) as client:
            yield client, srv
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        srv.stop()
        sock.close()


@pytest.fixture(scope="module")
def served(tiny_dir):
    with running(tiny_dir, "--max-batch", "4", "--max-new-tokens-limit", "64", "--max-seq-length", "512") as s:
        yield s


USAGE = {"stream_options": {"include_usage": True}}


def events(client, path, body) -> list:
    """The parsed `data:` events of a streamed request, the last one the string "[DONE]"; with include_usage
    (USAGE) every chunk's usage is null but the last chunk's, which has no choices."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    out = [json.loads(d) for d in data[:-1]]
    if body.get("stream_options", {}).get("include_usage") and "error" not in out[-1]:
        assert all(c["usage"] is None for c in out[:-1]) and out[-1]["choices"] == [], out
        return out[:-1] + [{**out[-2], "usage": out[-1]["usage"]}, "[DONE]"]      # usage put on the finish chunk
    assert all("usage" not in c for c in out)
    return out + ["[DONE]"]


def test_completion_streamed_and_not(served):
    client, srv = served
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    [choice] = out["choices"]
    assert choice["finish_reason"] == "length" and choice["text"]
    prompt_tokens = len(srv.tokenizer.encode(body["prompt"]))
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    chunks = events(client, "/v1/completions", {**body, **USAGE})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-2]["usage"] == out["usage"]

    cut = len(choice["text"]) // 2                  # a stop string from the middle of the greedy answer
    stop = choice["text"][cut:cut + 3]
    stopped = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == choice["text"][:choice["text"].index(stop)]
    chunks = events(client, "/v1/completions", {**body, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == stopped["text"]


def test_chat_streamed_and_not(served):
    client, srv = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert out["object"] == "chat.completion"
    [choice] = out["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    ids = srv.tokenizer.encode(srv.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                               add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 6
    chunks = events(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_repeats(served):
    client, _ = served
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7}
    texts = [client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]


def test_models_and_health(served):
    client, _ = served
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["rows_in_use"] == 0 and health["max_batch"] == 4


BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 65}, "max_tokens"),          # beyond --max-new-tokens-limit
    ("/v1/completions", {"prompt": "hi " * 500, "max_tokens": 64}, "prompt"),       # beyond --max-seq-length
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),     # Python's json reads NaN
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", 3]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
]


def test_bad_requests_are_400(served):
    client, _ = served
    for path, body, param in BAD:
        r = (client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body))
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    r = client.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
    assert r.status_code == 200 and client.get("/health").json()["rows_in_use"] == 0


def test_a_failed_step_is_a_500_and_serving_goes_on(served):
    client, srv = served

    def broken(tokens):
        raise RuntimeError("boom")
    lane = srv.lanes["full"]
    lane.batch.step = broken                                    # the next decode step fails (this batch only)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"] == {"message": "RuntimeError: boom", "type": "server_error",
                                                          "param": None, "code": None}
    assert complete(client, "hi again", 4)["usage"]["completion_tokens"] == 4      # on a fresh batch
    lane.batch.step = broken
    chunks = events(client, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert chunks[-2] == {"error": {"message": "RuntimeError: boom", "type": "server_error", "param": None,
                                    "code": None}}
    assert complete(client, "hi again", 4)["usage"]["completion_tokens"] == 4
    assert client.get("/health").json()["requests"]["error"] == 2


PROMPTS = {"The quick brown fox jumps over the lazy dog. " * 3: 20, "Hello": 9,
           "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12": 14, "A short story about a cat": 5}


def alone(checkpoint, flags, prompts, spec=None, chat=False) -> list:
    """engine.generate's greedy answer for each prompt alone (a user message in the chat template with chat=True),
    with the server's policy (`spec`, default its only one) and storage flags."""
    args = build_parser().parse_args(["--checkpoint", str(checkpoint), *flags])
    spec = spec or args.policies[0]
    model, tokenizer = engine.load_model(checkpoint, "cpu")
    return [engine.generate(model, tokenizer, [p], n, policy=engine.kv_policy(make_policy(spec), args), chat=chat)
            for p, n in prompts.items()]


def complete(client, prompt, max_tokens, **extra) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


SPECS = {"full": "full", "snapkv": "snapkv:budget=16,obs_window=8"}      # name -> spec, two started policies
TWO = "; ".join(SPECS.values())


def test_greedy_alongside_others_equals_alone(tiny_dir):
    """Two started policies, four requests of different lengths each, all sent at once (joining and leaving
    their policy's batch at different steps): each request gets the greedy answer engine.generate gives it
    alone with the policy its kv_policy names, and says which policy served it."""
    flags = ["--policies", TWO, "--max-batch", "3", "--max-new-tokens-limit", "32", "--max-seq-length", "256"]
    work = [(name, p, n) for name in SPECS for p, n in PROMPTS.items()]
    with running(tiny_dir, *flags) as (client, srv):
        assert list(srv.lanes) == list(SPECS)
        with ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda w: complete(client, w[1], w[2], kv_policy=w[0]), work))
    for name, spec in SPECS.items():
        outs = [out for out, w in zip(got, work) if w[0] == name]
        for out, ref in zip(outs, alone(tiny_dir, flags, PROMPTS, spec)):
            assert out["kv_policy"] == name
            assert out["choices"][0]["text"] == ref.texts[0]
            assert out["usage"]["completion_tokens"] == len(ref.tokens[0])


def post(client, body) -> httpx.Response:
    return client.post("/v1/completions", json={"temperature": 0, **body})


def test_a_requests_own_failure_fails_it_alone(tiny_dir, monkeypatch):
    """Faults injected for one request each (tokenizing, a prefill chunk, sampling, stop handling), sent together
    with good requests on both started policies: each faulty one alone gets a 500 (a streamed one an error event),
    every good one the greedy answer it gets alone; /metrics counts the 500s and the server serves on."""
    flags = ["--policies", TWO, "--max-batch", "3", "--prefill-chunk", "16", "--max-new-tokens-limit", "32",
             "--max-seq-length", "256"]
    with running(tiny_dir, *flags) as (client, srv):
        encode, prefill, hold_back, sampler = (srv.tokenizer.encode, srv.lanes["full"].batch.prefill,
                                               loop.hold_back, Sampler.__call__)
        bad_ids = encode("Bad prefill")

        def bad_encode(text, *a, **k):
            if "Bad tokenizer" in text:
                raise RuntimeError("tokenizer fault")
            return encode(text, *a, **k)

        def bad_prefill(model, tokens, *a):         # (any row of prompts prefilled together: it ends the row)
            if any(row[-len(bad_ids):].tolist() == bad_ids for row in tokens):
                raise RuntimeError("prefill fault")
            return prefill(model, tokens, *a)

        def bad_hold_back(text, stop):
            if "Bad stop" in stop:
                raise RuntimeError("stop fault")
            return hold_back(text, stop)

        def bad_sampler(self, logits):
            if self.generator is not None and self.generator.initial_seed() == 666:
                raise RuntimeError("sampler fault")
            return sampler(self, logits)
        monkeypatch.setattr(srv.tokenizer, "encode", bad_encode)
        monkeypatch.setattr(srv.lanes["full"].batch, "prefill", bad_prefill)
        monkeypatch.setattr(loop, "hold_back", bad_hold_back)
        monkeypatch.setattr(Sampler, "__call__", bad_sampler)
        faults = {"tokenizer fault": {"prompt": "Bad tokenizer"}, "prefill fault": {"prompt": "Bad prefill"},
                  "stop fault": {"prompt": "Hello", "stop": "Bad stop", "kv_policy": "snapkv"},
                  "sampler fault": {"prompt": "Hello", "seed": 666, "temperature": 1}}
        good = [(name, p, n) for name in SPECS for p, n in PROMPTS.items()]
        before = metrics(client)
        with ThreadPoolExecutor(len(good) + len(faults) + 1) as pool:
            ok = pool.map(lambda w: complete(client, w[1], w[2], kv_policy=w[0]), good)
            failed = pool.map(lambda body: post(client, {"max_tokens": 8, **body}), faults.values())
            streamed = pool.submit(events, client, "/v1/completions", {"prompt": "Bad prefill", "max_tokens": 4})
            ok, failed, streamed = list(ok), list(failed), streamed.result()
        after = metrics(client)
        assert complete(client, "Hello", 4)["usage"]["completion_tokens"] == 4      # a later request
    for r, message in zip(failed, faults):
        assert r.status_code == 500 and r.json()["error"] == {"message": f"RuntimeError: {message}",
                                                              "type": "server_error", "param": None, "code": None}
    assert streamed[-2:] == [{"error": {"message": "RuntimeError: prefill fault", "type": "server_error",
                                        "param": None, "code": None}}, "[DONE]"]
    for name, spec in SPECS.items():
        refs = alone(tiny_dir, flags, PROMPTS, spec)
        assert [out["choices"][0]["text"] for out, w in zip(ok, good) if w[0] == name] == [r.texts[0] for r in refs]
    delta = lambda name, **labels: after.get((name, frozenset(labels.items())), 0) - \
        before.get((name, frozenset(labels.items())), 0)                                    # noqa: E731
    assert delta("kvserve_http_requests_total", status="500") == len(faults) + 1      # the stream: as its twin
    assert delta("kvserve_http_requests_total", status="200") == len(good)
    assert sum(delta("kvserve_requests_finished_total", policy=name, reason="error") for name in SPECS) == 4


def test_a_failed_step_fails_its_lanes_rows_only(tiny_dir):
    """A failed decode step of one policy's batch fails the requests holding its rows (500) and nothing else: a
    request of that policy still waiting for a row, and the other policy's requests, get their greedy answers."""
    flags = ["--policies", TWO, "--max-batch", "2", "--max-new-tokens-limit", "32", "--max-seq-length", "256"]
    prompt, n = next(iter(PROMPTS.items()))
    with running(tiny_dir, *flags) as (client, srv):
        batch = srv.lanes["full"].batch
        step = batch.step

        def flaky(tokens):                  # fails once, when both rows decode
            if len(tokens) == 2:
                batch.step = step
                raise RuntimeError("boom")
            return step(tokens)
        batch.step = flaky
        work = [("full", prompt, n)] * 3 + [("snapkv", prompt, n)] * 2
        with ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda w: post(client, {"prompt": w[1], "max_tokens": w[2], "kv_policy": w[0]}),
                                work))
        assert srv.lanes["full"].batch is not batch                 # a fresh batch
        assert complete(client, prompt, n)["choices"][0]["text"]
    errors = [r for r in got if r.status_code == 500]
    assert len(errors) == 2 and {r.json()["error"]["message"] for r in errors} == {"RuntimeError: boom"}
    refs = {name: alone(tiny_dir, flags, {prompt: n}, spec)[0].texts[0] for name, spec in SPECS.items()}
    for r, (name, _, _) in zip(got, work):
        assert r.status_code == 500 or r.json()["choices"][0]["text"] == refs[name]
    assert [r.status_code for r in got[3:]] == [200, 200]


DOCUMENT = "Notes on the harbour: the boats leave at dawn, the nets dry at noon, the market opens at four. " * 6


def test_chunked_prefill_and_prefix_reuse(tiny_dir):
    """A long prompt is prefilled in --prefill-chunk pieces between the running rows' decode steps, and
    questions about one document reuse its prefilled prefix (full): the second request, which shares it with
    the first, keeps it, and the third prefills only its question (cached_tokens); the
    metrics count the hits, and every greedy answer equals engine.generate alone (which reuses nothing)."""
    flags = ["--max-batch", "2", "--prefill-chunk", "16", "--max-new-tokens-limit", "16", "--max-seq-length", "512"]
    questions = {DOCUMENT + f"Question {i}: when do the boats leave?": 8 for i in range(3)}
    with running(tiny_dir, *flags) as (client, srv):
        busy = ThreadPoolExecutor(1).submit(complete, client, "Count: 1, 2, 3,", 16)    # decoding meanwhile
        got = [complete(client, q, n) for q, n in questions.items()]
        busy.result(timeout=120)
        metrics = client.get("/metrics").text
    cached = [out["usage"]["prompt_tokens_details"]["cached_tokens"] for out in got]
    assert cached[:2] == [0, 0] and cached[2] >= 32, cached     # the second prefill keeps the shared prefix
    assert 'kvserve_prefix_hits_total{policy="full"} 1' in metrics, metrics
    for out, ref in zip(got, alone(tiny_dir, flags, questions, "full")):
        assert out["choices"][0]["text"] == ref.texts[0]


def test_agnostic_prefix_reuse_for_a_compressing_policy(tiny_dir):
    """snapkv: the second request sharing a document with the first compresses that shared prefix alone and
    appends its question (kv_protocol "agnostic", nothing cached yet), the third adopts the kept compressed prefix
    (cached_tokens); both answers equal engine.generate(question, context=prefill_context(prefix)) for the same
    split, the first's (its prompt compressed with its question, "aware") engine.generate alone's; `full` says
    "exact"; with --no-agnostic-reuse every snapkv prompt is "aware"."""
    flags = ["--policies", TWO, "--max-batch", "2", "--max-new-tokens-limit", "32", "--max-seq-length", "512"]
    questions = [DOCUMENT + f"Question {i}: when do the boats leave?" for i in range(3)]
    with running(tiny_dir, *flags) as (client, srv):
        got = [complete(client, q, 8, kv_policy="snapkv") for q in questions[:2]]
        chunks = events(client, "/v1/completions", {"prompt": questions[2], "max_tokens": 8, "temperature": 0,
                                                     "kv_policy": "snapkv", **USAGE})
        exact = complete(client, questions[0], 4)
        prefix = srv.lanes["snapkv"].prefixes
    ids = [srv.tokenizer.encode(q) for q in questions]
    split = common_prefix(ids[0], ids[1])
    assert split >= 32 and ids[2][:split] == ids[0][:split]
    assert [out["kv_protocol"] for out in got] == ["aware", "agnostic"] and exact["kv_protocol"] == "exact"
    assert {c["kv_protocol"] for c in chunks[:-1]} == {"agnostic"}
    cached = [out["usage"]["prompt_tokens_details"]["cached_tokens"] for out in got] + \
        [chunks[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]]
    assert cached == [0, 0, split] and prefix["hits"] == 1 and prefix["reused_tokens"] == split
    args = build_parser().parse_args(["--checkpoint", str(tiny_dir), *flags])
    model, tokenizer = engine.load_model(tiny_dir, "cpu")
    new_policy = lambda: engine.kv_policy(make_policy(SPECS["snapkv"]), args)        # noqa: E731
    ctx = prefill_context(model, tokenizer, ids[0][:split], new_policy, room=32)   # the rows' decode_room
    refs = engine.generate(model, tokenizer, [q[split:] for q in ids[1:]], 8, context=ctx).texts
    assert got[1]["choices"][0]["text"] == refs[0]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == refs[1]
    assert got[0]["choices"][0]["text"] == alone(tiny_dir, flags, {questions[0]: 8}, SPECS["snapkv"])[0].texts[0]
    with running(tiny_dir, *flags, "--no-agnostic-reuse") as (client, srv):
        assert [complete(client, q, 8, kv_policy="snapkv")["kv_protocol"] for q in questions] == ["aware"] * 3
        assert srv.lanes["snapkv"].batch.prefixes is None


def test_kv_policy_choices_and_metrics(tiny_dir):
    """/v1/models and /health list the started policies; no kv_policy means the first; an unknown one is a 400
    naming the choices; /metrics counts what was served, per policy."""
    flags = ["--policies", TWO, "--max-batch", "2", "--max-new-tokens-limit", "32", "--max-seq-length", "256"]
    with running(tiny_dir, *flags) as (client, srv):
        assert client.get("/v1/models").json()["data"][0]["kv_policies"] == list(SPECS)
        lanes = client.get("/health").json()["policies"]
        assert {name: {k: lane[k] for k in ("spec", "rows_in_use", "prefilling", "queue_depth", "rows_total")}
                for name, lane in lanes.items()} == {
            name: {"spec": spec, "rows_in_use": 0, "prefilling": 0, "queue_depth": 0, "rows_total": 2}
            for name, spec in SPECS.items()}
        before = metrics(client)
        assert complete(client, "Hello", 5)["kv_policy"] == "full"
        chunks = events(client, "/v1/completions", {"prompt": "Hello there", "max_tokens": 7, "kv_policy": "snapkv"})
        assert {c["kv_policy"] for c in chunks[:-1]} == {"snapkv"}
        r = client.post("/v1/completions", json={"prompt": "hi", "kv_policy": "h2o"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_policy"
        assert r.json()["error"]["message"] == ("kv_policy 'h2o' is not started on this server; choose one of: "
                                                "full, snapkv")
        after = metrics(client)

    def delta(name, **labels):
        key = (name, frozenset(labels.items()))
        return after.get(key, 0) - before.get(key, 0)
    assert delta("kvserve_http_requests_total", status="200") == 2
    assert delta("kvserve_http_requests_total", status="400") == 1
    assert delta("kvserve_prompt_tokens_total", policy="snapkv") == len(srv.tokenizer.encode("Hello there"))
    for policy, n in (("full", 5), ("snapkv", 7)):
        one = frozenset({"policy": policy}.items())
        assert delta("kvserve_requests_finished_total", policy=policy, reason="length") == 1
        assert delta("kvserve_generation_tokens_total", policy=policy) == n
        assert delta("kvserve_time_to_first_token_seconds_count", policy=policy) == 1
        assert delta("kvserve_inter_token_latency_seconds_count", policy=policy) == n - 1
        buckets = sorted((float(dict(k)["le"]), v) for (name, k), v in after.items()
                         if name == "kvserve_inter_token_latency_seconds_bucket" and dict(k)["policy"] == policy)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)          # cumulative
        assert buckets[-1] == (float("inf"), after["kvserve_inter_token_latency_seconds_count", one])
        assert after["kvserve_rows_in_use", one] == after["kvserve_queue_depth", one] == 0
        assert after["kvserve_rows_max", one] == 2
        assert after["kvserve_kv_allocated_bytes", one] == srv.lanes[policy].batch.policy.kv_bytes()["allocated"] > 0


def metrics(client) -> dict:
    """GET /metrics parsed: {(name, frozenset of label items): value}; every sample's family has HELP and TYPE."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out, typed = {}, set()
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            assert any(name == t or name.startswith(t + "_") for t in typed), line
            items = [kv.split("=", 1) for kv in labels.rstrip("}").split(",")] if labels else []
            out[name, frozenset((k, v.strip('"')) for k, v in items)] = float(value)
    return out


@pytest.mark.slow
def test_compiled_server_equals_eager_alone(tiny_dir):
    """--compile: the decode step is compiled at startup (warm-up through each policy's batch) and requests
    served together give the eager greedy answers."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()       # graphs of decode_step compiled by earlier tests in this process would be reused
    counters.clear()
    flags = ["--compile", "--max-batch", "2", "--max-new-tokens-limit", "32", "--max-seq-length", "256"]
    prompts = dict(list(PROMPTS.items())[:3])
    with running(tiny_dir, *flags) as (client, _):
        assert counters["stats"]["unique_graphs"] >= 1           # compiled before the first request
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda item: complete(client, *item), prompts.items()))
    for out, ref in zip(got, alone(tiny_dir, ["--max-seq-length", "256"], prompts, "full")):
        assert out["choices"][0]["text"] == ref.texts[0]


def test_batch_admission_policy(tiny_dir):
    """A policy that admits whole batches (pyramidkv, 4-bit KIVI storage) serves concurrent requests in
    groups, and a request served alone equals engine.generate's."""
    flags = ["--policy", "pyramidkv:budget=24", "--kv-bits", "4", "--max-batch", "2",
             "--max-new-tokens-limit", "32", "--max-seq-length", "256"]
    with running(tiny_dir, *flags) as (client, srv):
        assert srv.lanes["pyramidkv"].batch.policy.admission == "batch"
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda item: complete(client, *item), PROMPTS.items()))
        assert [out["usage"]["completion_tokens"] for out in got] == list(PROMPTS.values())
        first = dict([next(iter(PROMPTS.items()))])
        solo = complete(client, *next(iter(first.items())))
    [ref] = alone(tiny_dir, flags, first)
    assert solo["choices"][0]["text"] == ref.texts[0]


def wait_for(client, check, seconds=20):
    deadline = time.monotonic() + seconds
    while not check(client.get("/health").json()):
        assert time.monotonic() < deadline, json.dumps(client.get("/health").json())
        time.sleep(0.05)


def test_full_queue_is_429_and_a_disconnect_frees_the_row(tiny_dir):
    with running(tiny_dir, "--max-batch", "1", "--max-queue", "1", "--max-new-tokens-limit", "4000",
                 "--max-seq-length", "4100") as (client, srv):
        long = {"prompt": "Tell me everything", "max_tokens": 4000, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as a:
            assert a.status_code == 200
            lines = a.iter_lines()                                  # (kept: closing it would close A)
            next(lines)                                             # A runs in the only row
            with httpx.Client(base_url=client.base_url, timeout=30) as other, \
                    other.stream("POST", "/v1/completions", json={**long, "max_tokens": 3}) as b:
                assert b.status_code == 200                         # B waits in the queue
                wait_for(client, lambda h: h["rows_in_use"] == 1 and h["queue_depth"] == 1)
                c = client.post("/v1/completions", json={"prompt": "me too", "max_tokens": 2})
                assert c.status_code == 429 and c.headers["Retry-After"] == "1"
                assert c.json()["error"]["type"] == "rate_limit_error"
                a.close()                                           # A's client goes away mid-stream
                b_text = [line for line in b.iter_lines() if line.startswith("data: ")]
        assert b_text[-1] == "data: [DONE]" and '"finish_reason": "length"' in b_text[-2]
        wait_for(client, lambda h: h["rows_in_use"] == 0 and h["requests"].get("cancelled") == 1)
        assert srv.finished["full", "length"] == 1
        with pytest.raises(httpx.ReadTimeout):                      # a client that stops waiting for a whole answer
            client.post("/v1/completions", json={**long, "stream": False}, timeout=0.5)
        wait_for(client, lambda h: h["rows_in_use"] == 0 and h["requests"].get("cancelled") == 2)
        assert srv.finished["full", "length"] == 1


def test_hold_back_keeps_partial_characters_and_stop_prefixes():
    assert loop.hold_back("abc", []) == 0
    assert loop.hold_back("ab\ufffd", []) == 1                 # half a UTF-8 character
    assert loop.hold_back("xab", ["abc", "zz"]) == 2           # may become the stop string "abc"
    assert loop.hold_back("abc", ["xy"]) == 0


def test_outbox_wakes_each_event_loop_once_per_flush():
    """The engine thread's sends of one iteration reach the handlers' queues in order, with one wake-up of each
    event loop (call_soon_threadsafe) for all of them."""
    loops = [asyncio.new_event_loop() for _ in range(2)]
    calls = []
    for ev in loops:
        ev.call_soon_threadsafe = lambda *a, ev=ev, wake=ev.call_soon_threadsafe: (calls.append(ev), wake(*a))[1]
    job = lambda ev: loop.Job([1], 4, Sampler(), [], "full", ev)
    a, b, c = job(loops[0]), job(loops[0]), job(loops[1])
    box = loop.Outbox()
    for item in [(a, "text", "x"), (b, "text", "y"), (a, "text", "z"), (c, "done", "stop"), (a, "done", "length")]:
        box.post(item[0], *item[1:])
    assert calls == []
    box.flush()
    assert calls == loops and box.items == []
    for ev in loops:
        ev.run_until_complete(asyncio.sleep(0))
        ev.close()
    drain = lambda j: [j.out.get_nowait() for _ in range(j.out.qsize())]
    assert drain(a) == [("text", "x"), ("text", "z"), ("done", "length")]
    assert drain(b) == [("text", "y")] and drain(c) == [("done", "stop")]
    box.flush()
    assert len(calls) == 2                                      # nothing posted: no wake-up


def test_outbox_drops_what_a_closed_event_loop_would_get():
    """A handler's event loop closed before the engine thread flushes (a server shutting down): its items are
    dropped, the other loop's still arrive, and the engine thread goes on (no RuntimeError out of flush)."""
    closed, live = asyncio.new_event_loop(), asyncio.new_event_loop()
    closed.close()
    a, b = (loop.Job([1], 4, Sampler(), [], "full", ev) for ev in (closed, live))
    box = loop.Outbox()
    box.post(a, "text", "x")
    box.post(b, "text", "y")
    box.flush()
    live.run_until_complete(asyncio.sleep(0))
    live.close()
    assert b.out.get_nowait() == ("text", "y") and box.items == []

@contextlib.contextmanager
def cli(tiny_dir, *flags):
    """python serve.py on a free port (torch twins, one thread) -> (process, base URL, its stderr lines queue, a
    list to keep clients alive in); killed at the end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVC_CPU_KERNELS": "0"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "serve.py", "--checkpoint", str(tiny_dir), "--port", str(port),
                             *flags], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline, said = time.monotonic() + 120, []
        while not said or not said[-1].startswith("serving on"):
            said.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        assert said[0].startswith("loading ") and said[-1] == f"serving on http://127.0.0.1:{port}\n", said
        yield proc, f"http://127.0.0.1:{port}", lines, []
    finally:
        proc.kill()
        proc.wait(timeout=30)


def exits_cleanly(proc, lines, since: float, seconds: float) -> None:
    """The server exits 0 within `seconds` of `since` (time.monotonic), no traceback on its stderr."""
    assert proc.wait(timeout=30) == 0 and time.monotonic() - since < seconds
    out = []
    while not lines.empty():
        out.append(lines.get())
    assert "Traceback" not in "".join(out), out


def test_cli_says_where_it_serves_once_bound(tiny_dir):
    """python serve.py says "loading ..." then, once uvicorn has bound the port, "serving on
    http://127.0.0.1:PORT" on stderr: a request sent right after it is answered.  SIGTERM then stops the server
    (exit 0)."""
    with cli(tiny_dir) as (proc, url, lines, _):
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        exits_cleanly(proc, lines, t0, 60)
