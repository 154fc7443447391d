"""serve.py's engine thread: one `Lane` (a runtime.rows.RowBatch) per started policy, the `Job` each request shares
with its HTTP handler, and the `Engine` that owns the model and goes round the lanes (admission, decode steps,
sampling, streaming text back, failures).  Request handlers never touch the model: they `submit` a Job and
read its `out` queue.

    srv = Engine(model, tokenizer, {"full": ("full", make_full)}, max_batch=8, max_queue=64, max_seq_length=2048,
                 max_new_tokens=256)
    srv.thread.start(); srv.submit(job); ...; srv.stop()

server/app.py's main calls `srv.run()` in the main thread instead (uvicorn's loop runs in another): PyTorch's
OpenMP threads run the forwards faster for the process's main thread than for another (docs/serving.md, Threads).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from runtime.rows import Pending, RowBatch
from runtime.steps import Sampler, decode_step, prefill_step, warmup_length
from server.metrics import Histogram
from tokenizer import unfinished_tail

log = logging.getLogger("serve")


class QueueFull(RuntimeError):
    """Every row is busy and --max-queue requests already wait: 429."""


class ShuttingDown(RuntimeError):
    """The server stops at once (a second signal, or the drain limit passed): 503."""


STATUS = {"stop": 200, "length": 200, "cancelled": 499, "error": 500}      # a request's end -> its HTTP status


# --------------------------------------------------------------------------- one request

@dataclass
class Job:
    """One generation request, shared by its HTTP handler (which reads `out`) and the engine thread."""
    ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: list[str]
    lane: str                         # the name of the started policy that serves it
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)   # ("start", protocol), ("text", str)...,
                                                                # ("done", reason); or ("error", msg) (500) or
                                                                # ("unavailable", msg) (503) at any time
    tokens: list[int] = field(default_factory=list)
    sent: int = 0                     # characters of the text already sent
    cancelled: bool = False           # set by the handler when its client goes away
    pending: Optional[Pending] = None   # its staged admission (RowBatch.start), while its prompt is prefilled
    row: int = -1                     # its row in the lane's RowBatch, once admitted
    submitted: float = field(default_factory=time.monotonic)
    last: Optional[float] = None      # when its latest token was sampled (time.monotonic)
    rid: str = ""                     # its request id (X-Request-Id), in the log lines about it
    agnostic: bool = True             # may its prompt take the question-agnostic protocol (kv_reuse "any")

    def send(self, *item) -> None:
        """Deliver item now (from the HTTP side; the engine thread posts to its Outbox)."""
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class Outbox:
    """What the engine thread sends to the handlers during one iteration, delivered at its end with one wake-up of
    each event loop: a wake-up per token of every row preempts the forwards on few cores (docs/serving.md, Threads)."""

    def __init__(self):
        self.items: list = []             # [(job, item)], in the order posted

    def post(self, job: Job, *item) -> None:
        self.items.append((job, item))

    def flush(self) -> None:
        items, self.items = self.items, []
        by_loop: dict = {}
        for job, item in items:
            by_loop.setdefault(job.loop, []).append((job, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:        # its event loop is closed: nobody listens for these requests any more
                log.debug("dropped %d items for a closed event loop", len(batch))


def deliver(batch: list) -> None:
    """(On a handler's event loop) put each posted item into its job's queue."""
    for job, item in batch:
        job.out.put_nowait(item)


def failure(e: Exception, rids=()) -> str:
    """A failure of the requests `rids` (their ids, in the log line) as its error message (`Type: message`), logged
    with its traceback."""
    log.error("request %s failed", " ".join(rids) or "?", exc_info=e)
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
    batch: RowBatch
    waiting: list = field(default_factory=list)          # [Job], guarded by Engine.wake
    starting: list = field(default_factory=list)         # [Job] started in the batch, prompt not yet in
    rows: dict = field(default_factory=dict)             # row -> Job (the engine thread's own)
    kv: dict = field(default_factory=dict)               # the policy's latest kv_bytes(), read by /metrics
    kv_at: float = 0.0                                   # when it was read (time.monotonic)
    prefixes: dict = field(default_factory=dict)         # its kept prefixes' stats (runtime/prefix_cache.py)
    rows_total: int = 0                                  # rows its batch holds now (--kv-memory: those that fit)
    row_capacity: Optional[int] = None                   # full's rows sized to the requests: tokens a row holds


class Engine:
    """Owns the model, the tokenizer and one Lane per started policy; `run` (its own thread) goes round the
    lanes: each admits its waiting jobs into free rows, decodes one step of its active rows, samples each row
    with its own settings and streams the text back to the handlers.  The lanes share the model: before a
    lane runs, the model's cache is pointed at that lane's policy."""

    TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)       # seconds
    ITL_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

    def __init__(self, model, tokenizer, policies: dict, max_batch: int, max_queue: int, max_seq_length: int,
                 max_new_tokens: int, steps=(prefill_step, decode_step), prefill_chunk: int = 256,
                 prefix_bytes: int = 0, agnostic: bool = True, kv_memory: Optional[int] = None,
                 prefill_batch: int = 1, max_question: int = 64):
        """policies: {name: (spec text, a function making a fresh policy instance)}, the first the default;
        steps: the (prefill, decode) step functions (runtime.steps.compiled_steps for --compile); prefill_chunk: prompt
        tokens prefilled between two decode steps; prefix_bytes: kept prefixes per lane (runtime/prefix_cache.py);
        agnostic: compressing policies keep compressed prefixes (RowBatch's agnostic protocol); kv_memory: K/V
        bytes of all the lanes' rows (--kv-memory; None: --max-batch rows each), split in equal shares;
        prefill_batch: prompts prefilled together (RowBatch); max_question: the longest question appended under the
        agnostic protocol (RowBatch)."""
        self.model, self.tokenizer = model, tokenizer
        self.kv_memory, self.kv_share = kv_memory, None if kv_memory is None else kv_memory // len(policies)
        self.prefill_chunk, self.prefix_bytes, self.agnostic = prefill_chunk, prefix_bytes, agnostic
        self.prefill_batch, self.max_question = prefill_batch, max_question
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
        self.aborting: Optional[str] = None         # set by `abort`: every request fails with this (503)
        self.outbox = Outbox()                      # the engine thread's sends, flushed once an iteration
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        for lane in self.lanes.values():
            self.read_kv(lane)

    def new_batch(self, make_policy) -> RowBatch:
        prefill, decode = self.steps
        return RowBatch(self.model, make_policy, self.max_batch, self.max_seq_length, self.max_new_tokens,
                        prefill=prefill, decode=decode, prefill_chunk=self.prefill_chunk,
                        prefix_bytes=self.prefix_bytes, agnostic=self.agnostic,
                        share_prefix=decode is decode_step,        # not under --compile
                        kv_memory=self.kv_share, prefill_batch=self.prefill_batch,
                        max_question=self.max_question)

    def submit(self, job: Job) -> None:
        """Queue job for its lane: QueueFull when it would wait for a row (no free row takes it at the next
        iteration) while --max-queue requests already do; ShuttingDown after `abort`."""
        with self.wake:
            if self.aborting:
                raise ShuttingDown(self.aborting)
            lane = self.lanes[job.lane]
            if len(lane.waiting) >= max(lane.batch.room, 0):
                queued = sum(self.queued(other) for other in self.lanes.values())
                if queued >= self.max_queue:
                    raise QueueFull(f"{queued} requests already wait for a row; try again later")
            lane.waiting.append(job)
            self.wake.notify()

    @staticmethod
    def queued(lane: Lane) -> int:
        """(Under the lock) the lane's waiting requests that no free row takes at its next iteration."""
        return max(len(lane.waiting) - max(lane.batch.room, 0), 0)

    def cancel(self, job: Job) -> None:
        """job's client went away: a waiting job ends now (cancelled, 499), a started one at the engine's next
        iteration (its row freed)."""
        with self.wake:
            job.cancelled = True
            lane = self.lanes[job.lane]
            if any(j is job for j in lane.waiting):
                lane.waiting.remove(job)
                self.count(lane.name, "cancelled")
                job.send("done", "cancelled")

    def count(self, lane: str, reason: str, n: int = 1, status: Optional[int] = None) -> None:
        """(Under the lock) n requests of the lane ended for `reason`, answered with `status` (STATUS[reason])."""
        self.finished[lane, reason] += n
        self.http[status or STATUS[reason]] += n

    def abort(self, message: str = "the server is shutting down") -> None:
        """Stop at once: every request in flight or waiting fails with 503 (`message`) at the engine's next
        iteration, and `submit` refuses new ones; `run` goes on until request_stop.  Only sets state (a signal
        handler in the engine's thread may call it)."""
        with self.wake:
            self.aborting = message
            self.wake.notify()

    def request_stop(self) -> None:
        """`run` returns at its next iteration (failing the requests still in it)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def stop(self) -> None:
        """request_stop, then wait for `thread` (when `run` runs there)."""
        self.request_stop()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def health(self) -> dict:
        with self.wake:
            lanes = {name: {"spec": lane.spec, "rows_in_use": len(lane.rows), "prefilling": len(lane.starting),
                            "queue_depth": len(lane.waiting), **self.memory(lane)} for name, lane in self.lanes.items()}
            requests = Counter()
            for (_, outcome), n in self.finished.items():
                requests[outcome] += n
            return {"status": "ok", "rows_in_use": sum(p["rows_in_use"] for p in lanes.values()),
                    "max_batch": self.max_batch, "queue_depth": sum(p["queue_depth"] for p in lanes.values()),
                    "max_queue": self.max_queue, "kv_memory": self.kv_memory,
                    "requests": dict(requests), "policies": lanes,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}      # as it was when torch loaded

    def memory(self, lane: Lane) -> dict:
        """A lane's K/V memory as /health reports it (its kv_bytes as last read, read_kv)."""
        return {"kv_memory": self.kv_share, "kv_bytes_reserved": lane.kv.get("allocated", 0),
                "kv_bytes_in_use": lane.kv.get("live", 0), "rows_total": lane.rows_total,
                "rows_active": len(lane.rows) + len(lane.starting), "row_capacity": lane.row_capacity}

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
                    if self.aborting:
                        self.fail_lane(lane, self.aborting)
                        waiting[lane.name] = []
                    if waiting[lane.name] or lane.starting or lane.rows:
                        self.run_lane(lane, waiting[lane.name])
                self.outbox.flush()
        for lane in self.lanes.values():
            self.fail_lane(lane, "the server is shutting down")
        self.outbox.flush()

    def fail_lane(self, lane: Lane, message: str) -> None:
        """Every request of the lane (in a row, prefilling or waiting) fails with 503 (`message`): the server stops."""
        for job in list(lane.rows.values()) + list(lane.starting) + list(lane.waiting):
            self.fail_job(lane, job, message, 503)

    def drop_cancelled(self, lane: Lane) -> list:
        """(Under the lock) end the waiting jobs whose clients went away -> the lane's waiting jobs."""
        for job in [j for j in lane.waiting if j.cancelled]:
            lane.waiting.remove(job)
            self.count(lane.name, "cancelled")
            self.outbox.post(job, "done", "cancelled")
        return list(lane.waiting)

    def run_lane(self, lane: Lane, waiting: list) -> None:
        """One iteration of a lane.  A request's own failure fails it alone (`fail_job`), a failed decode step
        the lane's rows (`reset_lane`); anything else (freeing a row, say) fails every request of the lane, which
        goes on with a fresh RowBatch (the other lanes are not touched)."""
        try:
            self.iterate(lane, waiting)
        except Exception as e:                      # noqa: BLE001 -- fail the requests in flight, keep serving
            jobs = list(lane.rows.values()) + lane.starting + lane.waiting
            self.fail_jobs(lane, jobs, failure(e, [j.rid for j in jobs]))
            lane.batch = self.new_batch(lane.make_policy)       # a clean one
        self.read_kv(lane)

    def iterate(self, lane: Lane, waiting: list) -> None:
        """Drop the requests whose clients went away, one admission step, then one decode step of every active row."""
        self.model.use_cache(lane.batch.policy)       # the lanes share the model: this lane's cache
        for job in list(lane.rows.values()):
            if job.cancelled:
                self.finish(lane, job, "cancelled")
        for job in [j for j in lane.starting if j.cancelled]:
            lane.batch.cancel(job.pending)
            lane.starting.remove(job)
            with self.wake:
                self.count(lane.name, "cancelled")
            self.outbox.post(job, "done", "cancelled")
        self.admit(lane, waiting)
        if lane.batch.active:
            self.decode(lane)

    def admit(self, lane: Lane, waiting: list) -> None:
        """Admission, the one place prompts are prefilled: waiting jobs start while the batch has room (each
        reserves a row, first come first served; with --kv-memory the head of the queue waits until the bytes
        for it are free, RowBatch.can_start), then one RowBatch.advance: one prefill chunk of the oldest
        started prompt (a compressing policy's whole prompt), so prompts alternate with the rows' decode steps.
        A job whose prompt is complete samples its first token from the prompt's last logits.  A failure fails
        the job it happened in (RowBatch.advance drops that one: the started jobs it no longer holds)."""
        for job in waiting:             # first come first served: with --kv-memory, while the bytes for them are free
            if not lane.batch.can_start(len(job.ids) + job.max_tokens):
                break
            with self.wake:
                lane.waiting.remove(job)
            try:
                job.pending = lane.batch.start(job.ids, new_tokens=job.max_tokens, agnostic=job.agnostic)
                lane.starting.append(job)
            except Exception as e:              # noqa: BLE001 -- this request alone
                self.fail_job(lane, job, failure(e, [job.rid]))
        try:
            admitted = lane.batch.advance()
        except Exception as e:                  # noqa: BLE001 -- the requests it dropped
            dropped = [j for j in lane.starting if not lane.batch.holds(j.pending)]
            if not dropped:                     # prompts prefilled together: each goes again alone
                log.warning("a prefill of prompts together failed; each is prefilled again alone", exc_info=e)
                return
            message = failure(e, [j.rid for j in dropped])
            for job in dropped:
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
            return self.reset_lane(lane, failure(e, [j.rid for j in lane.rows.values()]))
        greedy = logits.float().argmax(-1).tolist()     # every row's greedy token, in one pass (a row's own
        for row, job in list(lane.rows.items()):        # argmax costs ~0.2 ms over a 49k vocabulary)
            self.emit(lane, job, logits[row], greedy[row] if job.sampler.temperature <= 0 else None)
        for row in lane.batch.joined:               # rows whose prompt this step completed (agnostic reuse)
            self.joined(lane, next(j for j in lane.starting if j.pending.row == row), logits[row])

    def joined(self, lane: Lane, job: Job, logits: torch.Tensor) -> None:
        """job's prompt is in its row (logits [V] of its last position): it says how (its protocol) and decodes
        from now on."""
        lane.starting.remove(job)
        job.row = job.pending.row
        lane.rows[job.row] = job
        with self.wake:
            self.tokens[lane.name, "prompt"] += len(job.ids)
        self.outbox.post(job, "start", job.pending.protocol)
        self.emit(lane, job, logits)

    def emit(self, lane: Lane, job: Job, logits: torch.Tensor, token: Optional[int] = None) -> None:
        """`sample`, a failure of which (sampling, stop strings, detokenizing) fails the job alone."""
        try:
            self.sample(lane, job, logits, token)
        except Exception as e:                  # noqa: BLE001 -- this request alone
            self.fail_job(lane, job, failure(e, [job.rid]))

    def sample(self, lane: Lane, job: Job, logits: torch.Tensor, token: Optional[int] = None) -> None:
        """Sample job's next token from logits [V] (`token`: its greedy token, found for the whole step), send the
        new text, finish it at EOS/stop/max_tokens."""
        token = int(job.sampler(logits[None])[0]) if token is None else token
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
            self.outbox.post(job, "text", text[job.sent:end])
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
            self.count(lane.name, reason)
        if len(text) > job.sent:
            self.outbox.post(job, "text", text[job.sent:])
        self.outbox.post(job, "done", reason)

    def fail_job(self, lane: Lane, job: Job, message: str, status: int = 500) -> None:
        """One request failed: free its row or its staged admission, count it, send it the error (`status`)."""
        if lane.rows.get(job.row) is job:
            del lane.rows[job.row]
            lane.batch.release(job.row)
        elif job in lane.starting:
            lane.starting.remove(job)
            if lane.batch.holds(job.pending):
                lane.batch.cancel(job.pending)
        self.fail_jobs(lane, [job], message, status)

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

    def fail_jobs(self, lane: Lane, jobs: list, message: str, status: int = 500) -> None:
        """Send the error (`status`: 500, or 503 when the server stops) to these jobs of the lane and forget them
        (their rows and staged admissions are the caller's to free, or its batch's to drop)."""
        with self.wake:
            self.count(lane.name, "error", len(jobs), status)
            lane.waiting = [j for j in lane.waiting if not any(j is k for k in jobs)]
        for job in jobs:
            if lane.rows.get(job.row) is job:
                del lane.rows[job.row]
            if job in lane.starting:
                lane.starting.remove(job)
            self.outbox.post(job, "error" if status == 500 else "unavailable", message)

    def read_kv(self, lane: Lane) -> None:
        """Refresh the lane's kept-prefix counters and KV byte counts for /metrics (here, on the engine thread: the
        buffers are its own), the KV bytes at most every quarter second while rows run."""
        now = time.monotonic()
        prefixes = lane.batch.prefixes.stats() if lane.batch.prefixes else {}     # host counters: always fresh
        with self.wake:
            lane.prefixes = prefixes
        if lane.rows and now - lane.kv_at < 0.25:
            return
        kv, batch = lane.batch.policy.kv_bytes(), lane.batch
        with self.wake:
            lane.kv, lane.kv_at = kv, now
            lane.rows_total = batch.batch_size if batch.rows else batch.max_batch
            lane.row_capacity = getattr(batch.policy, "capacity", None) if batch.sized else None

    def warm_up(self) -> None:
        """Run every lane through a few decode steps of --max-batch short requests, so that a compiled step
        (--compile) is compiled before the first request."""
        with torch.inference_mode():
            for lane in self.lanes.values():
                self.model.use_cache(lane.batch.policy)
                ids = [0] * warmup_length(lane.batch.policy)
                rows = {row: int(logits.argmax()) for row, logits in lane.batch.admit([ids] * self.max_batch)}
                for _ in range(3):
                    logits = lane.batch.step(rows)
                    rows = {row: int(logits[row].argmax()) for row in rows}
                for row in rows:
                    lane.batch.release(row)
