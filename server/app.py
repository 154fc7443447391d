"""An OpenAI-compatible HTTP server with continuous batching (runtime.rows.RowBatch), one batch per started policy.

    pip install -e '.[serve]'
    python serve.py --checkpoint checkpoints/SmolLM2-135M-Instruct --policies 'full; snapkv:budget=256' --port 8000

POST /v1/completions and /v1/chat/completions (non-streaming and `stream: true`, server-sent events ending
with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).  One engine thread owns the
model and the batches (server/loop.py): request handlers only validate, enqueue and await what the engine
sends back.  Each started policy (--policies) has its own RowBatch; a request's `kv_policy` field picks one
(default: the first).  A request joins its policy's running batch at the next step boundary (its prompt
prefilled in chunks between the rows' decode steps, or from a kept shared prefix), leaves at EOS,
`max_tokens`, a `stop` string or its client's disconnect; at most --max-batch rows run per policy,
--max-queue more wait (all policies together), beyond that the answer is 429.  docs/serving.md: the API.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import jinja2
import torch

import engine
from cache import PolicyError, make_policy, parse_spec_list
from checkpoint import WEIGHTS, CheckpointError
from kernels.cpu import cpu_kernels_available
from runtime.memory import parse_size
from runtime.steps import Sampler, UsageError, compiled_steps, decode_step, prefill_step
from server.loop import Engine, Job, QueueFull, ShuttingDown, failure
from server.metrics import Family, exposition, resident_bytes

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:         # the server's own dependencies are an extra
    uvicorn = None

log = logging.getLogger("serve")
API_KEY_ENV = "KVSERVE_API_KEY"         # --api-key's default


class BadRequest(ValueError):
    """A request the server refuses with 400 (`param`: the field at fault)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# --------------------------------------------------------------------------- request parsing

FIELDS = {"model": str, "prompt": str, "messages": list, "max_tokens": int, "max_completion_tokens": int,
          "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int, "stop": (str, list),
          "n": int, "stream": bool, "stream_options": dict, "user": str,
          "kv_policy": str,             # extension fields: which started policy serves the request,
          "kv_reuse": str}              # and whether its prompt may take the agnostic protocol ("any", "exact")
KV_REUSE = ("any", "exact")
CHAT_ROLES = ("system", "user", "assistant")            # and those the chat template names (`chat_roles`)
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "echo": False, "best_of": 1,
           "logit_bias": {}, "suffix": ""}     # accepted only at their no-op values


def check_fields(body) -> dict:
    """The JSON body -> its fields, None values dropped (BadRequest for a wrong type or an unsupported field)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for k, v in body.items():
        if k in NEUTRAL:
            if v not in (NEUTRAL[k], type(NEUTRAL[k])()):
                raise BadRequest(f"{k}={v!r} is not supported by this server", k)
        elif k not in FIELDS:
            raise BadRequest(f"unrecognized request argument: {k}", k)
        elif not isinstance(v, FIELDS[k]) or (isinstance(v, bool) and FIELDS[k] is not bool):
            raise BadRequest(f"{k} has the wrong type ({type(v).__name__})", k)
    return body


def chat_roles(tokenizer) -> tuple:
    """The roles a message may have: system, user, assistant, and those of tool, ipython and developer that the
    checkpoint's chat template names (quoted, as in `message['role'] == 'tool'`)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return CHAT_ROLES + tuple(r for r in ("tool", "ipython", "developer") if re.search(f"[\"']{r}[\"']", template))


def message_text(i: int, m, roles: tuple) -> dict:
    """messages[i] -> {"role", "content"}: content a string or a list of text parts ({"type": "text", "text"}),
    role one of `roles`."""
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
        raise BadRequest(f"messages[{i}] must be an object with a string 'role' and a 'content' that is a string "
                         f"or a list of text parts", "messages")
    if m["role"] not in roles:
        raise BadRequest(f"messages[{i}].role {m['role'][:64]!r} is not supported: this model's chat template takes "
                         f"{', '.join(roles)}", "messages")
    return {"role": m["role"], "content": content}


def chat_ids(tokenizer, messages: list) -> list[int]:
    """The messages rendered with the chat template and tokenized, their text as text (Tokenizer.encode_chat)."""
    roles = chat_roles(tokenizer)
    messages = [message_text(i, m, roles) for i, m in enumerate(messages)]
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as e:        # no template, or its raise_exception(...)
        raise BadRequest(f"the chat template refuses these messages: {e}", "messages") from None


def sampler_from(body: dict, device) -> Sampler:
    temperature, top_p, top_k = body.get("temperature", 1.0), body.get("top_p"), body.get("top_k")
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}", "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if top_k is not None and top_k < 1:
        raise BadRequest(f"top_k must be >= 1, got {top_k}", "top_k")
    seed = body.get("seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise BadRequest(f"seed must be in [0, 2**63), got {seed}", "seed")
    return Sampler(temperature, top_k, top_p,
                   torch.Generator(device).manual_seed(seed) if seed is not None else None)


def parse(srv: Engine, data: bytes, chat: bool, model_id: str, loop) -> tuple[Job, dict]:
    """A request body (JSON bytes) -> (its Job, the fields the response needs); BadRequest for anything the server
    refuses.  It tokenizes: handlers run it in a worker thread, off the event loop."""
    try:
        body = check_fields(json.loads(data))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if body.get("model", model_id) != model_id:
        raise BadRequest(f"model {body['model']!r} is not served here; this server serves {model_id!r}", "model")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    lane = body.get("kv_policy", next(iter(srv.lanes)))
    if lane not in srv.lanes:
        raise BadRequest(f"kv_policy {lane!r} is not started on this server; choose one of: {', '.join(srv.lanes)}",
                         "kv_policy")
    key = "messages" if chat else "prompt"
    if key not in body:
        raise BadRequest(f"'{key}' is required", key)
    stream_options = stream_options_of(body)
    reuse = body.get("kv_reuse", "any")
    if reuse not in KV_REUSE:
        raise BadRequest(f"kv_reuse must be one of {', '.join(KV_REUSE)}, got {reuse!r}", "kv_reuse")
    ids = chat_ids(srv.tokenizer, body["messages"]) if chat else srv.tokenizer.encode(body["prompt"])
    if not body[key] or not ids:
        raise BadRequest(f"'{key}' is empty", key)
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    room = min(srv.max_seq_length - len(ids), srv.max_new_tokens)      # a chat's default: what is left
    if name not in body and chat and room < 1:
        raise BadRequest(f"the prompt ({len(ids)} tokens) leaves no room for an answer in this server's context of "
                         f"{srv.max_seq_length} tokens", key)
    max_tokens = body.get(name, room if chat else 16)
    if not 1 <= max_tokens <= srv.max_new_tokens:
        raise BadRequest(f"{name} must be in [1, {srv.max_new_tokens}] (--max-new-tokens-limit), got {max_tokens}",
                         name)
    if len(ids) + max_tokens > srv.max_seq_length:
        raise BadRequest(f"prompt ({len(ids)} tokens) + {name} ({max_tokens}) = {len(ids) + max_tokens} exceeds "
                         f"this server's context of {srv.max_seq_length} tokens", key)
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    job = Job(ids, max_tokens, sampler_from(body, srv.model.output.weight.device), stop, lane, loop,
              agnostic=reuse == "any")
    return job, {"stream": body.get("stream", False), "chat": chat, **stream_options}


def stream_options_of(body: dict) -> dict:
    """stream_options ({"include_usage": bool}, only with stream: true) -> {"include_usage": bool}."""
    options = body.get("stream_options", {})
    if options and not body.get("stream", False):
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("stream_options takes only include_usage (true or false)", "stream_options")
    return {"include_usage": options.get("include_usage", False)}


# --------------------------------------------------------------------------- HTTP

REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")       # a client's X-Request-Id kept as it is: visible ASCII


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None,
          code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


class Guard:
    """ASGI middleware: every response carries `X-Request-Id` (the client's if it is 1-128 visible ASCII
    characters, else a new one; handlers read it as request.state.rid), and with an API key a /v1/ request
    without `Authorization: Bearer KEY` is answered 401."""

    def __init__(self, app, api_key: Optional[str] = None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = rid if REQUEST_ID.fullmatch(rid) else uuid.uuid4().hex
        scope.setdefault("state", {})["rid"] = rid

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)
        if self.api_key and scope["path"].startswith("/v1/") and not hmac.compare_digest(
                headers.get(b"authorization", b""), b"Bearer " + self.api_key.encode()):
            refused = error(401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await refused(scope, receive, tagged)
        await self.app(scope, receive, tagged)


async def read_body(request: HTTPRequest, limit: int):
    """The request's body -> bytes, or a 413 response as soon as it is known to be over `limit` bytes (from
    Content-Length before reading any, else while reading)."""
    too_big = error(413, f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return too_big
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            return too_big
    return bytes(data)


def make_app(srv: Engine, model_id: str, max_body_bytes: int = 2**20, api_key: Optional[str] = None,
             cors_origins: tuple = (), workers: int = 2) -> "Starlette":
    """The Starlette app: its handlers read and parse requests (tokenizing in `workers` threads, off the event
    loop) and enqueue them, the engine thread generates."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="parse")
    access = logging.getLogger("serve.access")

    async def generate(request: HTTPRequest, chat: bool):
        rid, t0 = request.state.rid, time.monotonic()
        response, job = await answer(request, chat, rid)
        if job is None:                 # refused before it was queued (a queued one: counted by the engine)
            with srv.wake:
                srv.http[response.status_code] += 1
        if not isinstance(response, StreamingResponse):
            access.info("%s %s %d %.3fs", rid, request.url.path, response.status_code, time.monotonic() - t0)
        return response

    async def answer(request: HTTPRequest, chat: bool, rid: str):
        data = await read_body(request, max_body_bytes)
        if not isinstance(data, bytes):
            return data, None
        loop = asyncio.get_running_loop()
        try:
            job, how = await loop.run_in_executor(pool, parse, srv, data, chat, model_id, loop)
            job.rid = rid
            srv.submit(job)
        except BadRequest as e:
            return error(400, str(e), param=e.param), None
        except QueueFull as e:
            return error(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}), None
        except ShuttingDown as e:
            return error(503, str(e), "server_error", code="shutting_down"), None
        except Exception as e:              # noqa: BLE001 -- a failure of this request alone (tokenizing, say)
            return error(500, failure(e, [rid]), "server_error"), None
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": model_id, "kv_policy": job.lane}
        usage = lambda: {"prompt_tokens": len(job.ids), "completion_tokens": len(job.tokens),    # noqa: E731
                         "prompt_tokens_details": {"cached_tokens": job.pending.reused if job.pending else 0},
                         "total_tokens": len(job.ids) + len(job.tokens)}
        if how["stream"]:
            chunks = stream(job, head, chat, usage if how["include_usage"] else None, request.url.path)
            return StreamingResponse(chunks, media_type="text/event-stream"), job
        return await whole(request, job, head, chat, usage), job

    async def whole(request: HTTPRequest, job: Job, head: dict, chat: bool, usage):
        """A non-streamed answer: the job's text once it ends (499 if its client left, 500/503 on an error)."""
        text, reason = [], None
        watcher = asyncio.create_task(watch(request, job))
        try:
            while True:
                kind, value = await job.out.get()
                if kind == "text":
                    text.append(value)
                elif kind == "start":
                    head["kv_protocol"] = value
                elif kind in ("error", "unavailable"):
                    reason = kind
                    return (error(500, value, "server_error") if kind == "error" else
                            error(503, value, "server_error", code="shutting_down"))
                else:
                    reason = value
                    break
        finally:
            watcher.cancel()
            if reason is None:                      # this handler was cancelled
                srv.cancel(job)
        if reason == "cancelled":                   # (nobody reads it: the client went away)
            return error(499, "the client closed the request", "client_closed_request")
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}} if chat else
                  {"index": 0, "text": "".join(text), "logprobs": None})
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [{**choice, "finish_reason": reason}], "usage": usage()})

    async def watch(request: HTTPRequest, job: Job):
        """Cancel the job once its client goes away (a streamed response is cancelled by Starlette instead)."""
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        srv.cancel(job)

    async def stream(job: Job, head: dict, chat: bool, usage, path: str):
        """Server-sent events: the job's text as chunks, the last with finish_reason; with usage (include_usage)
        every chunk has "usage": null and one more, with no choices, carries it; then [DONE].  An error is an
        error event, then [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {} if usage is None else {"usage": None}

        def chunk(delta: dict, reason=None) -> str:
            c = {"delta": delta} if chat else {"text": delta.get("content", ""), "logprobs": None}
            return sse({**head, "object": obj, "choices": [{"index": 0, **c, "finish_reason": reason}], **extra})

        end, t0 = None, time.monotonic()
        try:
            while end is None:
                kind, value = await job.out.get()
                if kind == "start":                 # the prompt is in: how it is held is known
                    head["kv_protocol"] = value
                    if chat:
                        yield chunk({"role": "assistant", "content": ""})
                elif kind == "text":
                    yield chunk({"content": value})
                elif kind in ("error", "unavailable"):
                    end = kind
                    yield sse(error_body(value, "server_error", code=None if kind == "error" else "shutting_down"))
                else:
                    end = value
                    yield chunk({}, value)
                    if usage is not None:
                        yield sse({**head, "object": obj, "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"
        finally:
            if end is None:                         # the client left (or the server stops): free its row
                srv.cancel(job)
            access.info("%s %s stream %s %.3fs", job.rid, path, end or "cancelled", time.monotonic() - t0)

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "kvpolicy-engine",
                "kv_policies": list(srv.lanes)}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):
        if request.path_params["name"] != model_id:
            return error(404, f"the model {request.path_params['name']!r} does not exist; this server serves "
                              f"{model_id!r}", param="model", code="model_not_found")
        return JSONResponse(model_card())

    async def health(request):
        return JSONResponse({**srv.health(), "max_body_bytes": max_body_bytes})

    async def metrics(request):
        return PlainTextResponse(exposition(metric_families(srv)), media_type="text/plain; version=0.0.4")

    async def http_error(request, exc):             # 404, 405 (Starlette's HTTPException) in OpenAI's shape
        what = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return error(exc.status_code, what.get(exc.status_code, str(exc.detail)), headers=exc.headers,
                     code="not_found" if exc.status_code == 404 else None)

    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                             allow_headers=["*"], expose_headers=["X-Request-Id"])] if cors_origins else []
    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/v1/models/{name:path}", model),
                             Route("/health", health), Route("/metrics", metrics)],
                     middleware=middleware + [Middleware(Guard, api_key=api_key)],
                     exception_handlers={404: http_error, 405: http_error})


def metric_families(srv: Engine) -> list[Family]:
    """GET /metrics: the server's counters, gauges and histograms (names in docs/serving.md)."""
    with srv.wake:
        lanes = srv.lanes.values()
        by = lambda values: [({"policy": lane.name}, values(lane)) for lane in lanes]     # noqa: E731
        return [
            Family("kvserve_http_requests_total", "counter", "generation requests answered, by HTTP status",
                   [({"status": str(code)}, n) for code, n in sorted(srv.http.items())]),
            Family("kvserve_requests_finished_total", "counter", "requests ended, by policy and reason "
                   "(stop, length, cancelled, error)", [({"policy": name, "reason": reason}, n)
                                                        for (name, reason), n in sorted(srv.finished.items())]),
            Family("kvserve_queue_depth", "gauge", "requests waiting for a row", by(lambda lane: len(lane.waiting))),
            Family("kvserve_rows_in_use", "gauge", "rows holding a request", by(lambda lane: len(lane.rows))),
            Family("kvserve_rows_prefilling", "gauge", "rows whose request's prompt is being prefilled",
                   by(lambda lane: len(lane.starting))),
            Family("kvserve_rows_max", "gauge", "rows of the policy's batch now (--max-batch, or with --kv-memory "
                   "those that fit its share)", by(lambda lane: lane.rows_total)),
            Family("kvserve_kv_memory_bytes", "gauge", "the policy's share of --kv-memory (absent without it)",
                   by(lambda lane: srv.kv_share) if srv.kv_share is not None else []),
            Family("kvserve_prompt_tokens_total", "counter", "prompt tokens of requests whose prompt is in (reused "
                   "prefixes included)",
                   by(lambda lane: srv.tokens[lane.name, "prompt"])),
            Family("kvserve_generation_tokens_total", "counter", "tokens generated (EOS not counted)",
                   by(lambda lane: srv.tokens[lane.name, "completion"])),
            Family("kvserve_prefix_reused_tokens_total", "counter", "prompt tokens copied from a kept prefix "
                   "instead of prefilled", by(lambda lane: lane.prefixes.get("reused_tokens", 0))),
            Family("kvserve_prefix_hits_total", "counter", "prompts that started from a kept prefix",
                   by(lambda lane: lane.prefixes.get("hits", 0))),
            Family("kvserve_prefix_bytes", "gauge", "bytes of the kept prefixes (--prefix-cache-mb bounds them)",
                   by(lambda lane: lane.prefixes.get("bytes", 0))),
            Family("kvserve_kv_live_bytes", "gauge", "KV cache bytes holding tokens (policy.kv_bytes)",
                   by(lambda lane: lane.kv["live"])),
            Family("kvserve_kv_allocated_bytes", "gauge", "KV cache bytes allocated (policy.kv_bytes)",
                   by(lambda lane: lane.kv["allocated"])),
            Family("kvserve_time_to_first_token_seconds", "histogram", "from arrival to the first sampled token",
                   [s for lane in lanes for s in srv.ttft[lane.name].samples({"policy": lane.name})]),
            Family("kvserve_inter_token_latency_seconds", "histogram", "between a request's sampled tokens",
                   [s for lane in lanes for s in srv.itl[lane.name].samples({"policy": lane.name})]),
            Family("process_resident_memory_bytes", "gauge", "the server process's resident set size",
                   [({}, rss) for rss in [resident_bytes()] if rss is not None]),
        ]


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--policies", "--policy", action="append", metavar="SPEC[;SPEC...]",
                   help="KV-cache policy specs NAME[@LABEL][:key=value,...] separated by ';' or the flag repeated "
                        "(default: full); each gets its own batch of --max-batch rows, and a request picks one by "
                        "its kv_policy field (NAME[@LABEL]; default: the first)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--kv-memory", metavar="SIZE",
                   help="K/V bytes of the rows of all started policies together, split in equal shares (e.g. 2GiB, "
                        "512MiB): each policy runs as many rows as its share holds (a compressed row is small), at "
                        "most --max-batch; full sizes its rows to the requests; a request waits for the bytes. "
                        "Default: --max-batch rows of --max-seq-length each (docs/serving.md, memory admission)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max-new-tokens-limit", type=int, default=256, help="the largest max_tokens a request may ask")
    p.add_argument("--max-seq-length", type=int, default=2048,
                   help="tokens per row, prompt + max_tokens (capped at the model's context)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="tokens of each prompt prefilled between two decode steps of the running rows (a "
                        "compressing policy stages the chunks and compresses the prompt after the last; pod: one pass)")
    p.add_argument("--prefill-batch", type=int, default=4,
                   help="waiting prompts prefilled together, left-padded, in one forward per chunk (those that "
                        "start alike: from the same kept prefix or none; KIVI storage: 1)")
    p.add_argument("--prefix-cache-mb", type=float, default=256,
                   help="MiB per policy of prefilled prompt prefixes kept for reuse (a prompt starting with a kept "
                        "prefix prefills only the rest: exact with full, compressed without the question with "
                        "--agnostic-reuse: runtime/prefix_cache.py); 0: off")
    p.add_argument("--agnostic-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="a policy that compresses the prompt keeps shared prefixes compressed without their question "
                        "and appends each request's question (the question-agnostic protocol; responses say "
                        "kv_protocol 'agnostic'); --no-agnostic-reuse: every prompt is compressed with its question "
                        "('aware'). Within --prefix-cache-mb")
    p.add_argument("--agnostic-max-question", type=int, default=64,
                   help="the longest question (the prompt after its shared prefix) a request may append one token a "
                        "decode step under --agnostic-reuse; a longer one is compressed with its prompt ('aware')")
    p.add_argument("--max-body-bytes", type=int, default=2**20,
                   help="the largest request body (bytes); a larger one is answered 413 before it is read")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"requests to /v1/ must send 'Authorization: Bearer KEY' (else 401); default ${API_KEY_ENV}")
    p.add_argument("--cors-origins", default="",
                   help="origins allowed to call the API from a browser, comma-separated ('*': any); default none")
    p.add_argument("--shutdown-timeout", type=float, default=30,
                   help="seconds the requests in flight may take after SIGTERM/SIGINT before they are stopped (503)")
    p.add_argument("--access-log", action="store_true", help="one log line per request (its X-Request-Id, status)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the id /v1/models reports and requests may name (default: the checkpoint's)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help="as engine.py")
    p.add_argument("--omp-wait-policy", choices=["default", "passive", "active", "inherit"], default="default",
                   help="how the compute threads wait between ops (OMP_WAIT_POLICY for this process, applied when "
                        "serve.py starts): default (OMP_WAIT_POLICY unset: OpenMP's own, spin a short while, then "
                        "sleep), passive, active (threads that spin hold every core, so each wake-up of the HTTP "
                        "thread or of a client on the same cores preempts one mid-step: docs/serving.md), or "
                        "inherit the environment's")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (runtime.steps.compiled_steps), compiled at startup")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: not supported by the server (only 1)")
    engine.add_kv_flags(p)
    return p


def build_engine(args) -> Engine:
    """Validate the flags, load the model, compile with --compile, start nothing yet
    (UsageError/PolicyError/CheckpointError)."""
    if args.prefix_cache_mb < 0:
        raise UsageError("--prefix-cache-mb must be at least 0")
    if args.shutdown_timeout < 0:
        raise UsageError("--shutdown-timeout must be at least 0")
    try:
        kv_memory = None if args.kv_memory is None else parse_size(args.kv_memory)
    except ValueError as e:
        raise UsageError(f"--kv-memory: {e}") from None
    for flag in ("max_batch", "max_queue", "max_new_tokens_limit", "prefill_chunk", "prefill_batch", "max_body_bytes",
                 "agnostic_max_question"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.tp != 1:
        raise UsageError("serve.py does not support --tp: the server runs the model in one process "
                         "(engine.py and the benchmark take --tp under torchrun)")
    specs = parse_spec_list(args.policies or ["full"])
    for spec in specs:
        engine.kv_policy(make_policy(spec), args)               # a bad spec fails before loading
    model, tokenizer = engine.load_model(args.checkpoint, args.device, args.dtype, args.weights)
    if model.output.weight.device.type == "cpu":
        cpu_kernels_available()                 # build the C++ kernels now (saying so), not in the first request
    engine.check_kv_fits(args, model.args)
    max_seq_length = min(args.max_seq_length, model.args.max_position_embeddings)
    if args.max_new_tokens_limit >= max_seq_length:
        raise UsageError(f"--max-new-tokens-limit {args.max_new_tokens_limit} leaves no room for a prompt "
                         f"in --max-seq-length {max_seq_length}")

    def maker(spec):
        def fresh():                            # a new policy instance (RowBatch makes its batch's and scratch's)
            policy = engine.kv_policy(make_policy(spec), args)
            policy.prepare(model, tokenizer)    # calibration files it needs, made on first use
            return policy
        return fresh
    steps = compiled_steps(model.output.weight.device) if args.compile else (prefill_step, decode_step)
    try:
        srv = Engine(model, tokenizer, {spec.variant: (str(spec), maker(spec)) for spec in specs}, args.max_batch,
                     args.max_queue, max_seq_length, args.max_new_tokens_limit, steps, args.prefill_chunk,
                     int(args.prefix_cache_mb * 2 ** 20), args.agnostic_reuse, kv_memory, args.prefill_batch,
                     args.agnostic_max_question)
    except ValueError as e:
        if kv_memory is None:
            raise
        raise UsageError(f"--kv-memory: {e}") from None
    if args.compile:
        srv.warm_up()
    return srv


def announce(server: "uvicorn.Server", http: threading.Thread) -> None:
    """One line on stderr, "serving on http://HOST:PORT", once uvicorn has bound its port (`server.started`);
    none if it never does (`http`, the thread running it, ended first)."""
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"serving on http://{f'[{host}]' if ':' in host else host}:{port}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if uvicorn is None:
        print("serve.py needs its extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.access_log:
        logging.getLogger("serve.access").setLevel(logging.INFO)
    print(f"loading {args.checkpoint} ...", file=sys.stderr, flush=True)
    try:
        srv = build_engine(args)
    except (UsageError, CheckpointError, PolicyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_id = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    app = make_app(srv, model_id, **app_options(args))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout + 10))

    def http() -> None:                             # uvicorn's event loop, in a thread of its own
        try:
            server.run()
        finally:
            srv.request_stop()                      # its requests in flight are done: the engine may stop

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal(server, srv, args.shutdown_timeout))
    thread = threading.Thread(target=http, name="http", daemon=True)
    thread.start()
    threading.Thread(target=announce, args=(server, thread), name="announce", daemon=True).start()
    try:
        srv.run()                                   # the engine loop in the main thread (docs/serving.md, Threads)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    return 0 if server.started else 1               # (the port could not be bound: uvicorn said why)


def app_options(args) -> dict:
    """make_app's keyword arguments from serve.py's flags."""
    return {"max_body_bytes": args.max_body_bytes, "api_key": args.api_key,
            "cors_origins": tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())}


def on_signal(server: "uvicorn.Server", srv: Engine, drain_s: float):
    """SIGTERM/SIGINT's handler: the first stops accepting and lets the requests in flight finish, for up to
    drain_s seconds; a second signal, or the drain limit, stops them (`Engine.abort`: 503, an error event in a
    stream); a third exits at once."""
    count = []

    def handle(*_) -> None:
        count.append(1)
        if len(count) == 1:
            print(f"stopping: the requests in flight may finish (up to {drain_s:g} s; a second signal stops them)",
                  file=sys.stderr, flush=True)
            server.should_exit = True
            timer = threading.Timer(drain_s, srv.abort, [f"the server is shutting down: the requests in flight "
                                                         f"had {drain_s:g} s to finish"])
            timer.daemon = True
            timer.start()
        elif len(count) == 2:
            srv.abort("the server is shutting down")
        else:
            server.force_exit = True
    return handle
