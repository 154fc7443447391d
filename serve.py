"""An OpenAI-compatible HTTP server with continuous batching (engine.RowBatch), one batch per started policy.

    pip install -e '.[serve]'
    python serve.py --checkpoint checkpoints/SmolLM2-135M-Instruct --policies 'full; snapkv:budget=256' --port 8000

POST /v1/completions and /v1/chat/completions (non-streaming and `stream: true`, server-sent events ending
with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).  One engine thread owns the
model and the batches: request handlers only validate, enqueue and await what the engine sends back.  Each
started policy (--policies) has its own RowBatch; a request's `kv_policy` field picks one (default: the first).
A request joins its policy's running batch at the next step boundary (its prompt prefilled whole), leaves at
EOS, `max_tokens`, a `stop` string or its client's disconnect; at most --max-batch rows run per policy,
--max-queue more wait (all policies together), beyond that the answer is 429.  docs/serving.md: the API.
"""
from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")      # as engine.py: see its docstring

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import jinja2
import torch

import engine
from cache import PolicyError, make_policy, parse_spec_list
from checkpoint import CheckpointError
from serve_metrics import Family, Histogram, exposition
from tokenizer import unfinished_tail

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:         # the server's own dependencies are an extra
    uvicorn = None


log = logging.getLogger("serve")


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
    lane: str                         # the name of the started policy that serves it
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)   # ("text", str)... ("done", reason) or ("error", msg)
    tokens: list[int] = field(default_factory=list)
    sent: int = 0                     # characters of the text already sent
    cancelled: bool = False           # set by the handler when its client goes away
    pending: Optional[engine.Pending] = None   # its staged admission (RowBatch.start), while its prompt is prefilled
    row: int = -1                     # its row in the lane's RowBatch, once admitted
    submitted: float = field(default_factory=time.monotonic)
    last: Optional[float] = None      # when its latest token was sampled (time.monotonic)

    def send(self, *item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


def failure(e: Exception) -> str:
    """A request's failure as its error message (`Type: message`), logged with its traceback."""
    log.error("request failed", exc_info=e)
    return f"{type(e).__name__}: {e}"


def hold_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` that must not be sent yet: a partial UTF-8 character or the start of a
    stop string."""
    return max([unfinished_tail(text)] + [k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])])


# --------------------------------------------------------------------------- the engine thread

@dataclass
class Lane:
    """One started policy: its own RowBatch (at most --max-batch rows), the requests waiting for one of its rows
    (first come, first served) and those in its rows."""
    name: str                         # the spec's NAME[@LABEL]: what a request's kv_policy names
    spec: str                         # the whole spec, as started
    make_policy: Callable
    batch: engine.RowBatch
    waiting: list = field(default_factory=list)          # [Job], guarded by Engine.wake
    starting: list = field(default_factory=list)         # [Job] started in the batch, prompt being prefilled
    rows: dict = field(default_factory=dict)             # row -> Job (the engine thread's own)
    kv: dict = field(default_factory=dict)               # the policy's latest kv_bytes(), read by /metrics
    kv_at: float = 0.0                                   # when it was read (time.monotonic)
    prefixes: dict = field(default_factory=dict)         # its kept prefixes' stats (prefix_cache.py), read with kv


class Engine:
    """Owns the model, the tokenizer and one Lane per started policy; `run` (its own thread) goes round the
    lanes: each admits its waiting jobs into free rows, decodes one step of its active rows, samples each row
    with its own settings and streams the text back to the handlers.  The lanes share the model: before a
    lane runs, the model's cache is pointed at that lane's policy."""

    TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)       # seconds
    ITL_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

    def __init__(self, model, tokenizer, policies: dict, max_batch: int, max_queue: int, max_seq_length: int,
                 max_new_tokens: int, steps=(engine.prefill_step, engine.decode_step), prefill_chunk: int = 256,
                 prefix_bytes: int = 0):
        """policies: {name: (spec text, a function making a fresh policy instance)}, the first the default;
        steps: the (prefill, decode) step functions (engine.compiled_steps for --compile); prefill_chunk: prompt
        tokens prefilled between two decode steps; prefix_bytes: kept prefixes per lane (prefix_cache.py)."""
        self.model, self.tokenizer = model, tokenizer
        self.prefill_chunk, self.prefix_bytes = prefill_chunk, prefix_bytes
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_seq_length, self.max_new_tokens = max_seq_length, max_new_tokens
        self.steps = steps
        self.lanes = {name: Lane(name, spec, make, self.new_batch(make)) for name, (spec, make) in policies.items()}
        self.eos = set(tokenizer.eos_ids)
        self.finished: Counter = Counter()          # (lane, "stop"/"length"/"cancelled"/"error") -> requests
        self.tokens: Counter = Counter()            # (lane, "prompt"/"completion") -> tokens
        self.http: Counter = Counter()              # HTTP status of the generation requests -> count
        self.ttft = {name: Histogram(self.TTFT_BOUNDS) for name in self.lanes}
        self.itl = {name: Histogram(self.ITL_BOUNDS) for name in self.lanes}
        self.wake = threading.Condition()           # guards the queues and the counters above
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        for lane in self.lanes.values():
            self.read_kv(lane)

    def new_batch(self, make_policy) -> engine.RowBatch:
        prefill, decode = self.steps
        return engine.RowBatch(self.model, make_policy, self.max_batch, self.max_seq_length, self.max_new_tokens,
                               prefill=prefill, decode=decode, prefill_chunk=self.prefill_chunk,
                               prefix_bytes=self.prefix_bytes)

    def submit(self, job: Job) -> None:
        with self.wake:
            waiting = sum(len(lane.waiting) for lane in self.lanes.values())
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests already wait for a row; try again later")
            self.lanes[job.lane].waiting.append(job)
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=30)

    def health(self) -> dict:
        with self.wake:
            lanes = {name: {"spec": lane.spec, "rows_in_use": len(lane.rows), "prefilling": len(lane.starting),
                            "queue_depth": len(lane.waiting)} for name, lane in self.lanes.items()}
            requests = Counter()
            for (_, outcome), n in self.finished.items():
                requests[outcome] += n
            return {"status": "ok", "rows_in_use": sum(p["rows_in_use"] for p in lanes.values()),
                    "max_batch": self.max_batch, "queue_depth": sum(p["queue_depth"] for p in lanes.values()),
                    "max_queue": self.max_queue, "requests": dict(requests), "policies": lanes}

    def run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.wake:
                    while not (self.stopping or any(lane.waiting or lane.starting or lane.rows
                                                    for lane in self.lanes.values())):
                        self.wake.wait()
                    if self.stopping:
                        break
                    waiting = {name: self.drop_cancelled(lane) for name, lane in self.lanes.items()}
                for lane in self.lanes.values():
                    if waiting[lane.name] or lane.starting or lane.rows:
                        self.run_lane(lane, waiting[lane.name])
        for lane in self.lanes.values():
            self.fail_jobs(lane, list(lane.rows.values()) + lane.starting + lane.waiting, "the server is shutting down")

    def drop_cancelled(self, lane: Lane) -> list:
        """(Under the lock) forget the waiting jobs whose clients went away -> the lane's waiting jobs."""
        for job in [j for j in lane.waiting if j.cancelled]:
            lane.waiting.remove(job)
            self.finished[lane.name, "cancelled"] += 1
        return list(lane.waiting)

    def run_lane(self, lane: Lane, waiting: list) -> None:
        """One iteration of a lane.  A request's own failure fails it alone (`fail_job`), a failed decode step
        the lane's rows (`reset_lane`); anything else (freeing a row, say) fails every request of the lane, which
        goes on with a fresh RowBatch (the other lanes are not touched)."""
        try:
            self.iterate(lane, waiting)
        except Exception as e:                      # noqa: BLE001 -- fail the requests in flight, keep serving
            self.fail_jobs(lane, list(lane.rows.values()) + lane.starting + lane.waiting, failure(e))
            lane.batch = self.new_batch(lane.make_policy)       # a clean one
        self.read_kv(lane)

    def iterate(self, lane: Lane, waiting: list) -> None:
        """Drop the requests whose clients went away, one admission step, then one decode step of every active row."""
        self.model.cache = lane.batch.policy        # the lanes share the model: this lane's cache
        for job in list(lane.rows.values()):
            if job.cancelled:
                self.finish(lane, job, "cancelled")
        for job in [j for j in lane.starting if j.cancelled]:
            lane.batch.cancel(job.pending)
            lane.starting.remove(job)
            with self.wake:
                self.finished[lane.name, "cancelled"] += 1
        self.admit(lane, waiting)
        if lane.batch.active:
            self.decode(lane)

    def admit(self, lane: Lane, waiting: list) -> None:
        """Admission, the one place prompts are prefilled: waiting jobs start while the batch has room (each
        reserves a row, first come first served), then one RowBatch.advance: one prefill chunk of the oldest
        started prompt (a compressing policy's whole prompt), so prompts alternate with the rows' decode steps.
        A job whose prompt is complete samples its first token from the prompt's last logits.  A failure fails
        the job it happened in (RowBatch.advance drops that one: the started jobs it no longer holds)."""
        taken = waiting[:max(lane.batch.room, 0)]
        with self.wake:
            del lane.waiting[:len(taken)]
        for job in taken:
            try:
                job.pending = lane.batch.start(job.ids)
                lane.starting.append(job)
            except Exception as e:              # noqa: BLE001 -- this request alone
                self.fail_job(lane, job, failure(e))
        try:
            admitted = lane.batch.advance()
        except Exception as e:                  # noqa: BLE001 -- the requests it dropped
            message = failure(e)
            for job in [j for j in lane.starting if not lane.batch.holds(j.pending)]:
                self.fail_job(lane, job, message)
            return
        for row, logits in admitted:
            self.joined(lane, next(j for j in lane.starting if j.pending.row == row), logits)

    def decode(self, lane: Lane) -> None:
        """One decode step of the lane's active rows, each row's token sampled; a failed step is the lane's
        (`reset_lane`)."""
        try:
            logits = lane.batch.step({row: job.tokens[-1] for row, job in lane.rows.items()})
        except Exception as e:                  # noqa: BLE001 -- no one row to blame
            return self.reset_lane(lane, failure(e))
        for row, job in list(lane.rows.items()):
            self.emit(lane, job, logits[row])

    def joined(self, lane: Lane, job: Job, logits: torch.Tensor) -> None:
        """job's prompt is in its row (logits [V] of its last position): it decodes from now on."""
        lane.starting.remove(job)
        job.row = job.pending.row
        lane.rows[job.row] = job
        with self.wake:
            self.tokens[lane.name, "prompt"] += len(job.ids)
        self.emit(lane, job, logits)

    def emit(self, lane: Lane, job: Job, logits: torch.Tensor) -> None:
        """`sample`, a failure of which (sampling, stop strings, detokenizing) fails the job alone."""
        try:
            self.sample(lane, job, logits)
        except Exception as e:                  # noqa: BLE001 -- this request alone
            self.fail_job(lane, job, failure(e))

    def sample(self, lane: Lane, job: Job, logits: torch.Tensor) -> None:
        """Sample job's next token from logits [V], send the new text, finish it at EOS/stop/max_tokens."""
        token = int(job.sampler(logits[None])[0])
        self.observe(lane, job, token not in self.eos)
        if token in self.eos:
            return self.finish(lane, job, "stop", self.tokenizer.decode(job.tokens) if job.tokens else "")
        job.tokens.append(token)
        text = self.tokenizer.decode(job.tokens)
        cut = min([i for i in (text.find(s, max(job.sent - len(s), 0)) for s in job.stop) if i >= 0], default=-1)
        if cut >= 0:
            return self.finish(lane, job, "stop", text[:cut])
        if len(job.tokens) >= job.max_tokens:
            return self.finish(lane, job, "length", text)
        end = len(text) - hold_back(text, job.stop)
        if end > job.sent:
            job.send("text", text[job.sent:end])
            job.sent = end

    def observe(self, lane: Lane, job: Job, generated: bool) -> None:
        """Time a sampled token (TTFT for the first, inter-token latency after) and count it if it is text."""
        now = time.monotonic()
        with self.wake:
            if job.last is None:
                self.ttft[lane.name].observe(now - job.submitted)
            else:
                self.itl[lane.name].observe(now - job.last)
            self.tokens[lane.name, "completion"] += generated
        job.last = now

    def finish(self, lane: Lane, job: Job, reason: str, text: str = "") -> None:
        """Free job's row and count it, then send its last text and the end (a client that reads the end
        finds the row free and the count made)."""
        del lane.rows[job.row]
        lane.batch.release(job.row)
        with self.wake:
            self.finished[lane.name, reason] += 1
        if len(text) > job.sent:
            job.send("text", text[job.sent:])
        job.send("done", reason)

    def fail_job(self, lane: Lane, job: Job, message: str) -> None:
        """One request failed: free its row or its staged admission, count it, send it the error (500)."""
        if lane.rows.get(job.row) is job:
            del lane.rows[job.row]
            lane.batch.release(job.row)
        elif job in lane.starting:
            lane.starting.remove(job)
            if lane.batch.holds(job.pending):
                lane.batch.cancel(job.pending)
        self.fail_jobs(lane, [job], message)

    def reset_lane(self, lane: Lane, message: str) -> None:
        """A decode step failed: no one row is to blame, so every request holding a row of the lane's batch fails
        (500); those whose prefill had not completed go back to the head of the queue, and the lane goes on with
        a fresh RowBatch (its kept prefixes are lost with the old one)."""
        again = [j for j in lane.starting if j.pending in lane.batch.pending]
        self.fail_jobs(lane, list(lane.rows.values()) + [j for j in lane.starting if j not in again], message)
        for job in again:
            job.pending = None
        with self.wake:
            lane.waiting[:0] = again
        lane.batch = self.new_batch(lane.make_policy)

    def fail_jobs(self, lane: Lane, jobs: list, message: str) -> None:
        """Send the error to these jobs of the lane and forget them (their rows and staged admissions are the
        caller's to free, or its batch's to drop)."""
        with self.wake:
            self.finished[lane.name, "error"] += len(jobs)
            lane.waiting = [j for j in lane.waiting if j not in jobs]
        for job in jobs:
            if lane.rows.get(job.row) is job:
                del lane.rows[job.row]
            if job in lane.starting:
                lane.starting.remove(job)
            job.send("error", message)

    def read_kv(self, lane: Lane) -> None:
        """Refresh the lane's kept-prefix counters and KV byte counts for /metrics (here, on the engine thread: the
        buffers are its own), the KV bytes at most every quarter second while rows run."""
        now = time.monotonic()
        prefixes = lane.batch.prefixes.stats() if lane.batch.prefixes else {}     # host counters: always fresh
        with self.wake:
            lane.prefixes = prefixes
        if lane.rows and now - lane.kv_at < 0.25:
            return
        kv = lane.batch.policy.kv_bytes()
        with self.wake:
            lane.kv, lane.kv_at = kv, now

    def warm_up(self) -> None:
        """Run every lane through a few decode steps of --max-batch short requests, so that a compiled step
        (--compile) is compiled before the first request."""
        with torch.inference_mode():
            for lane in self.lanes.values():
                self.model.cache = lane.batch.policy
                ids = [0] * engine.warmup_length(lane.batch.policy)
                rows = {row: int(logits.argmax()) for row, logits in lane.batch.admit([ids] * self.max_batch)}
                for _ in range(3):
                    logits = lane.batch.step(rows)
                    rows = {row: int(logits[row].argmax()) for row in rows}
                for row in rows:
                    lane.batch.release(row)


# --------------------------------------------------------------------------- request parsing

FIELDS = {"model": str, "prompt": str, "messages": list, "max_tokens": int, "max_completion_tokens": int,
          "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int, "stop": (str, list),
          "n": int, "stream": bool, "stream_options": dict, "user": str,
          "kv_policy": str}             # the extension field: which started policy serves the request
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


def message_text(i: int, m) -> dict:
    """messages[i] -> {"role", "content"}: content a string or a list of text parts ({"type": "text", "text"})."""
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
        raise BadRequest(f"messages[{i}] must be an object with a string 'role' and a 'content' that is a string "
                         f"or a list of text parts", "messages")
    return {"role": m["role"], "content": content}


def chat_text(tokenizer, messages: list) -> str:
    messages = [message_text(i, m) for i, m in enumerate(messages)]
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
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
    lane = body.get("kv_policy", next(iter(srv.lanes)))
    if lane not in srv.lanes:
        raise BadRequest(f"kv_policy {lane!r} is not started on this server; choose one of: {', '.join(srv.lanes)}",
                         "kv_policy")
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
    job = Job(ids, max_tokens, sampler_from(body, srv.model.output.weight.device), stop, lane, loop)
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
        response = await answer(request, chat)
        with srv.wake:
            srv.http[response.status_code] += 1
        return response

    async def answer(request: HTTPRequest, chat: bool):
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
        except Exception as e:              # noqa: BLE001 -- a failure of this request alone (tokenizing, say)
            return error(500, failure(e), "server_error")
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": model_id, "kv_policy": job.lane}
        usage = lambda: {"prompt_tokens": len(job.ids), "completion_tokens": len(job.tokens),    # noqa: E731
                         "prompt_tokens_details": {"cached_tokens": job.pending.reused if job.pending else 0},
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
        if reason == "cancelled":                   # (nobody reads it: the client went away)
            return error(499, "the client closed the request", "client_closed_request")
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
                                                         "owned_by": "kvpolicy-engine",
                                                         "kv_policies": list(srv.lanes)}]})

    async def health(request):
        return JSONResponse(srv.health())

    async def metrics(request):
        return PlainTextResponse(exposition(metric_families(srv)), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)])


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
            Family("kvserve_rows_max", "gauge", "rows of the policy's batch (--max-batch)",
                   by(lambda lane: srv.max_batch)),
            Family("kvserve_prompt_tokens_total", "counter", "prompt tokens of started requests (reused prefixes included)",
                   by(lambda lane: srv.tokens[lane.name, "prompt"])),
            Family("kvserve_generation_tokens_total", "counter", "tokens generated (EOS not counted)",
                   by(lambda lane: srv.tokens[lane.name, "completion"])),
            Family("kvserve_prefix_reused_tokens_total", "counter", "prompt tokens copied from a kept prefix "
                   "instead of prefilled (full only)", by(lambda lane: lane.prefixes.get("reused_tokens", 0))),
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
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max-new-tokens-limit", type=int, default=256, help="the largest max_tokens a request may ask")
    p.add_argument("--max-seq-length", type=int, default=2048,
                   help="tokens per row, prompt + max_tokens (capped at the model's context)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled between two decode steps of the running rows (a policy that "
                        "compresses the prompt prefills it in one pass)")
    p.add_argument("--prefix-cache-mb", type=float, default=256,
                   help="MiB per policy of prefilled prompt prefixes kept for reuse (a prompt starting with a kept "
                        "prefix prefills only the rest; exact, full only: prefix_cache.py); 0: off")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the id /v1/models reports and requests may name (default: the checkpoint's)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--weights", choices=engine.WEIGHTS, default="auto", help="as engine.py")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (engine.compiled_steps), "
                                                          "compiled at startup")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: not supported by the server (only 1)")
    engine.add_kv_flags(p)
    return p


def build_engine(args) -> Engine:
    """Validate the flags, load the model, compile with --compile, start nothing yet
    (UsageError/PolicyError/CheckpointError)."""
    if args.prefix_cache_mb < 0:
        raise engine.UsageError("--prefix-cache-mb must be at least 0")
    for flag in ("max_batch", "max_queue", "max_new_tokens_limit", "prefill_chunk"):
        if getattr(args, flag) < 1:
            raise engine.UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.tp != 1:
        raise engine.UsageError("serve.py does not support --tp: the server runs the model in one process "
                                "(engine.py and the benchmark take --tp under torchrun)")
    specs = parse_spec_list(args.policies or ["full"])
    for spec in specs:
        engine.kv_policy(make_policy(spec), args)               # a bad spec fails before loading
    model, tokenizer = engine.load_model(args.checkpoint, args.device, args.dtype, args.weights)
    engine.check_kv_fits(args, model.args)
    max_seq_length = min(args.max_seq_length, model.args.max_position_embeddings)
    if args.max_new_tokens_limit >= max_seq_length:
        raise engine.UsageError(f"--max-new-tokens-limit {args.max_new_tokens_limit} leaves no room for a prompt "
                                f"in --max-seq-length {max_seq_length}")

    def maker(spec):
        def fresh():                            # a new policy instance (RowBatch makes its batch's and scratch's)
            policy = engine.kv_policy(make_policy(spec), args)
            policy.prepare(model, tokenizer)    # calibration files it needs, made on first use
            return policy
        return fresh
    steps = engine.compiled_steps(model.output.weight.device) if args.compile else (engine.prefill_step,
                                                                                     engine.decode_step)
    srv = Engine(model, tokenizer, {spec.variant: (str(spec), maker(spec)) for spec in specs}, args.max_batch,
                 args.max_queue, max_seq_length, args.max_new_tokens_limit, steps, args.prefill_chunk,
                 int(args.prefix_cache_mb * 2 ** 20))
    if args.compile:
        srv.warm_up()
    return srv


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
