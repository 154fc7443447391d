"""An OpenAI-compatible HTTP server with continuous batching (engine.RowBatch).

    pip install -e '.[serve]'
    python serve.py --checkpoint checkpoints/SmolLM2-135M-Instruct --policy snapkv:budget=256 --port 8000

POST /v1/completions and /v1/chat/completions (non-streaming and `stream: true`, server-sent events ending
with `data: [DONE]`), GET /v1/models, GET /health.  One engine thread owns the model and the batch: request
handlers only validate, enqueue and await what the engine sends back.  A request joins the running batch at
the next step boundary (its prompt prefilled whole), leaves at EOS, `max_tokens`, a `stop` string or its
client's disconnect; at most --max-batch rows run, --max-queue more wait, beyond that the answer is 429.
"""
from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")      # as engine.py: see its docstring

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import jinja2
import torch

import engine
from cache import PolicyError, make_policy
from checkpoint import CheckpointError

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:         # the server's own dependencies are an extra
    uvicorn = None


class BadRequest(ValueError):
    """A request the server refuses with 400 (`param`: the field at fault)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """Every row is busy and --max-queue requests already wait: 429."""


# --------------------------------------------------------------------------- one request

@dataclass
class Job:
    """One generation request, shared by its HTTP handler (which reads `out`) and the engine thread."""
    ids: list[int]
    max_tokens: int
    sampler: engine.Sampler
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)   # ("text", str)... ("done", reason) or ("error", msg)
    tokens: list[int] = field(default_factory=list)
    sent: int = 0                     # characters of the text already sent
    cancelled: bool = False           # set by the handler when its client goes away

    def send(self, *item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


def hold_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` that must not be sent yet: a partial UTF-8 character or the start of a
    stop string."""
    partial = len(text) - len(text.rstrip("\ufffd"))
    return max([partial] + [k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])])


# --------------------------------------------------------------------------- the engine thread

class Engine:
    """Owns the model, the tokenizer and one RowBatch; `run` (its own thread) admits waiting jobs (first come,
    first served) into free rows, decodes one step of every active row, samples each row with its own settings
    and streams the text back to the handlers."""

    def __init__(self, model, tokenizer, make_policy, max_batch: int, max_queue: int, max_seq_length: int,
                 max_new_tokens: int):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_seq_length, self.max_new_tokens = max_seq_length, max_new_tokens
        self.batch = engine.RowBatch(model, make_policy, max_batch, max_seq_length, max_new_tokens)
        self.eos = set(tokenizer.eos_ids)
        self.waiting: list[Job] = []
        self.rows: dict[int, Job] = {}
        self.outcomes: Counter = Counter()          # finished requests by finish reason / "cancelled" / "error"
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)

    def submit(self, job: Job) -> None:
        with self.wake:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests already wait for a row; try again later")
            self.waiting.append(job)
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=30)

    def health(self) -> dict:
        with self.wake:
            return {"status": "ok", "rows_in_use": len(self.rows), "max_batch": self.max_batch,
                    "queue_depth": len(self.waiting), "max_queue": self.max_queue, "requests": dict(self.outcomes)}

    def count(self, outcome: str) -> None:
        with self.wake:
            self.outcomes[outcome] += 1

    def run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.wake:
                    while not (self.stopping or self.waiting or self.rows):
                        self.wake.wait()
                    if self.stopping:
                        break
                    for job in [j for j in self.waiting if j.cancelled]:
                        self.waiting.remove(job)
                        self.outcomes["cancelled"] += 1     # (under the lock already)
                    waiting = list(self.waiting)
                try:
                    self.iterate(waiting)
                except Exception as e:              # noqa: BLE001 -- fail the requests in flight, keep serving
                    self.fail_all(f"{type(e).__name__}: {e}")
                    self.batch = engine.RowBatch(self.model, self.batch.make_policy, self.max_batch,
                                                 self.max_seq_length, self.max_new_tokens)   # a clean one
        self.fail_all("the server is shutting down")

    def iterate(self, waiting: list[Job]) -> None:
        """Admit what fits, then one decode step of every active row."""
        for job in list(self.rows.values()):
            if job.cancelled:
                self.finish(job, "cancelled")
        admitted = self.batch.admit([job.ids for job in waiting]) if waiting else []
        with self.wake:
            del self.waiting[:len(admitted)]        # admit takes a prefix of the queue, in order
        for (row, logits), job in zip(admitted, waiting):
            self.rows[row] = job
            self.emit(job, logits)
        if self.rows:
            logits = self.batch.step({row: job.tokens[-1] for row, job in self.rows.items()})
            for row, job in list(self.rows.items()):
                self.emit(job, logits[row])

    def emit(self, job: Job, logits: torch.Tensor) -> None:
        """Sample job's next token from logits [V], send the new text, finish it at EOS/stop/max_tokens."""
        token = int(job.sampler(logits[None])[0])
        if token in self.eos:
            return self.finish(job, "stop", self.tokenizer.decode(job.tokens) if job.tokens else "")
        job.tokens.append(token)
        text = self.tokenizer.decode(job.tokens)
        cut = min([i for i in (text.find(s, max(job.sent - len(s), 0)) for s in job.stop) if i >= 0], default=-1)
        if cut >= 0:
            return self.finish(job, "stop", text[:cut])
        if len(job.tokens) >= job.max_tokens:
            return self.finish(job, "length", text)
        end = len(text) - hold_back(text, job.stop)
        if end > job.sent:
            job.send("text", text[job.sent:end])
            job.sent = end

    def finish(self, job: Job, reason: str, text: str = "") -> None:
        if len(text) > job.sent:
            job.send("text", text[job.sent:])
        job.send("done", reason)
        self.release(job)
        self.count(reason)

    def release(self, job: Job) -> None:
        row = next(r for r, j in self.rows.items() if j is job)
        del self.rows[row]
        self.batch.release(row)

    def fail_all(self, message: str) -> None:
        """Send the error to every request in flight or waiting; their rows are forgotten (the batch is rebuilt
        after a failed step, dropped at shutdown)."""
        with self.wake:
            jobs, self.waiting = list(self.rows.values()) + self.waiting, []
            self.outcomes["error"] += len(jobs)
        for job in jobs:
            job.send("error", message)
        self.rows.clear()


# --------------------------------------------------------------------------- request parsing

FIELDS = {"model": str, "prompt": str, "messages": list, "max_tokens": int, "max_completion_tokens": int,
          "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int, "stop": (str, list),
          "n": int, "stream": bool, "stream_options": dict, "user": str}
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


def chat_text(tokenizer, messages: list) -> str:
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    try:
        return tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                             add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as e:        # no template, or its raise_exception(...)
        raise BadRequest(f"the chat template refuses these messages: {e}", "messages") from None


def sampler_from(body: dict, device) -> engine.Sampler:
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
    return engine.Sampler(temperature, top_k, top_p,
                          torch.Generator(device).manual_seed(seed) if seed is not None else None)


def parse(srv: Engine, body, chat: bool, model_id: str, loop) -> tuple[Job, dict]:
    """A request body -> (its Job, the fields the response needs); BadRequest for anything the server refuses."""
    body = check_fields(body)
    if body.get("model", model_id) != model_id:
        raise BadRequest(f"model {body['model']!r} is not served here; this server serves {model_id!r}", "model")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    key = "messages" if chat else "prompt"
    if key not in body:
        raise BadRequest(f"'{key}' is required", key)
    if chat:
        ids = srv.tokenizer.encode(chat_text(srv.tokenizer, body["messages"]), add_special_tokens=False)
    else:
        ids = srv.tokenizer.encode(body["prompt"])
    if not body[key] or not ids:
        raise BadRequest(f"'{key}' is empty", key)
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(name, srv.max_new_tokens if chat else 16)
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
    job = Job(ids, max_tokens, sampler_from(body, srv.model.output.weight.device), stop, loop)
    return job, {"stream": body.get("stream", False), "chat": chat}


# --------------------------------------------------------------------------- HTTP

def error_body(message: str, kind: str = "invalid_request_error", param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def make_app(srv: Engine, model_id: str) -> "Starlette":
    """The Starlette app: its handlers validate and enqueue, the engine thread generates."""

    async def generate(request: HTTPRequest, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the body is not valid JSON: {e}")
        try:
            job, how = parse(srv, body, chat, model_id, asyncio.get_running_loop())
            srv.submit(job)
        except BadRequest as e:
            return error(400, str(e), param=e.param)
        except QueueFull as e:
            return error(429, str(e), "rate_limit_error", headers={"Retry-After": "1"})
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": model_id}
        usage = lambda: {"prompt_tokens": len(job.ids), "completion_tokens": len(job.tokens),    # noqa: E731
                         "total_tokens": len(job.ids) + len(job.tokens)}
        if how["stream"]:
            return StreamingResponse(stream(job, head, chat, usage), media_type="text/event-stream")
        text, reason = [], None
        watcher = asyncio.create_task(watch(request, job))
        try:
            while True:
                kind, value = await job.out.get()
                if kind == "text":
                    text.append(value)
                elif kind == "error":
                    return error(500, value, "server_error")
                else:
                    reason = value
                    break
        finally:
            watcher.cancel()
            job.cancelled = reason is None          # an error
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}} if chat else
                  {"index": 0, "text": "".join(text), "logprobs": None})
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [{**choice, "finish_reason": reason}], "usage": usage()})

    async def watch(request: HTTPRequest, job: Job):
        """Cancel the job once its client goes away (a streamed response notices by itself)."""
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        job.cancelled = True

    async def stream(job: Job, head: dict, chat: bool, usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict, reason=None, **extra) -> str:
            c = {"delta": delta} if chat else {"text": delta.get("content", ""), "logprobs": None}
            return sse({**head, "object": obj, "choices": [{"index": 0, **c, "finish_reason": reason}], **extra})

        done = False
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            while not done:
                kind, value = await job.out.get()
                if kind == "text":
                    yield chunk({"content": value})
                elif kind == "error":
                    done = True
                    yield sse(error_body(value, "server_error"))
                else:
                    done = True
                    yield chunk({}, value, usage=usage())
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = not done                # a client that disconnects mid-stream frees its row

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                                         "owned_by": "kvpolicy-engine"}]})

    async def health(request):
        return JSONResponse(srv.health())

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--policy", default="full", help="KV-cache policy spec NAME[:key=value,...] (as engine.py)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max-new-tokens-limit", type=int, default=256, help="the largest max_tokens a request may ask")
    p.add_argument("--max-seq-length", type=int, default=2048,
                   help="tokens per row, prompt + max_tokens (capped at the model's context)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the id /v1/models reports and requests may name (default: the checkpoint's)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--weights", choices=engine.WEIGHTS, default="auto", help="as engine.py")
    engine.add_kv_flags(p)
    return p


def build_engine(args) -> Engine:
    """Validate the flags, load the model, start nothing yet (UsageError/PolicyError/CheckpointError)."""
    for flag in ("max_batch", "max_queue", "max_new_tokens_limit"):
        if getattr(args, flag) < 1:
            raise engine.UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    engine.kv_policy(make_policy(args.policy), args)               # a bad spec fails before loading
    model, tokenizer = engine.load_model(args.checkpoint, args.device, args.dtype, args.weights)
    engine.check_kv_fits(args, model.args)
    max_seq_length = min(args.max_seq_length, model.args.max_position_embeddings)
    if args.max_new_tokens_limit >= max_seq_length:
        raise engine.UsageError(f"--max-new-tokens-limit {args.max_new_tokens_limit} leaves no room for a prompt "
                                f"in --max-seq-length {max_seq_length}")

    def fresh():                                # a new policy instance (RowBatch makes its batch's and scratch's)
        policy = engine.kv_policy(make_policy(args.policy), args)
        policy.prepare(model, tokenizer)        # calibration files it needs, made on first use
        return policy
    return Engine(model, tokenizer, fresh, args.max_batch, args.max_queue, max_seq_length,
                  args.max_new_tokens_limit)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if uvicorn is None:
        print("serve.py needs its extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    try:
        srv = build_engine(args)
    except (engine.UsageError, CheckpointError, PolicyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_id = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    for sig in (signal.SIGTERM, signal.SIGINT):     # uvicorn stops gracefully (finishing the requests in flight),
        signal.signal(sig, lambda *_: None)         # then raises the signal again: exit 0 instead of dying by it
    srv.thread.start()
    try:
        uvicorn.run(make_app(srv, model_id), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=30)
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
