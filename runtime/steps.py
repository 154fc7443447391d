"""The forward steps and the loops around them: prefill (in chunks) and decode steps, their compiled forms and
warm-up, sampling, and the errors the runtime reports (UsageError, CacheFull)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cache.full import FullCache, read_bound
from model import Transformer
from tokenizer import Tokenizer


class UsageError(ValueError):
    """Bad input from the user: reported as a one-line message, never a traceback."""


class CacheFull(ValueError):
    """A decode step past the cache's max_seq_length: refused before anything is written."""


# --------------------------------------------------------------------------- sampling

def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V] without host syncs (greedy when temperature == 0)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p      # always keeps the top token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    # Gumbel-style sampling: argmax(p / Exp(1)) ~ Categorical(p), no torch.multinomial sync
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


@dataclass
class Sampler:
    """Sampling settings, validated once (UsageError naming the flag and its allowed range)."""
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    generator: Optional[torch.Generator] = None

    def __post_init__(self):
        if not self.temperature >= 0:               # also refuses NaN
            raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, self.temperature, self.top_k, self.top_p, self.generator)


# --------------------------------------------------------------------------- steps

def decode_step(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, n_filled: int) -> torch.Tensor:
    """One decode forward: token [B, 1] at input_pos [B, 1] -> logits [B, V].

    `n_filled` (the cache's live length) comes in as an argument so `torch.compile` treats it
    as a dynamic int: one compiled graph serves every step."""
    return model(token, input_pos, decode=True, n_filled=n_filled)[:, -1]


def static_decode_step(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, n_read: int) -> torch.Tensor:
    """One static decode forward over a cache with static_decode whose host count begin_static_step advanced:
    token, input_pos [B, 1] -> logits [B, V].  Its one int is the read bound n_read (a bucket), so a CUDA graph
    captured at one bound replays for every step inside that bucket."""
    return model(token, input_pos, decode=True, n_read=n_read)[:, -1]


class GraphDecode:
    """A decode step with decode_step's signature over two compiled steps: `static` (static_decode_step; on CUDA
    compiled with mode="reduce-overhead": one CUDA graph per batch size and read bucket, replayed) where the
    cache has a static decode step, else `dynamic` (decode_step, plain Inductor, no graphs).  `dynamic_caches`
    names the caches that took the dynamic step (the stats line says so)."""

    def __init__(self, static, dynamic):
        self.static, self.dynamic = static, dynamic
        self.dynamic_caches: set[str] = set()
        self.shapes: set[tuple[int, int]] = set()   # (batch, read bound) of the static steps: a graph each
        self.static_steps = self.dynamic_steps = 0

    def __call__(self, model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, n_filled: int):
        cache = model.cache
        if not cache.static_decode:
            name = getattr(cache, "name", type(cache).__name__)      # (model.py's DenseCache has no name)
            self.dynamic_caches.add(f"{name} ({getattr(cache, 'storage_kind', 'dense')} storage)")
            self.dynamic_steps += 1
            return self.dynamic(model, token, input_pos, n_filled)
        n_read = cache.begin_static_step()
        # a graph reads and writes them in place, never copied in; checked at every step, as a policy may allocate
        # per request or reallocate between steps.  mark_static_address costs ~45 us a call (measured 2026-11-29 on
        # the Xeon: 11.7 ms for 250 tensors), reading the attribute it sets ~0.1 us: only new tensors are marked
        for t in cache.static_tensors() + [model.rope_cos, model.rope_sin]:
            if getattr(t, "_dynamo_static_input_type", None) is None:
                torch._dynamo.mark_static_address(t)
        self.shapes.add((token.shape[0], n_read))
        self.static_steps += 1
        # a copy: the next replay overwrites a graph's output, and callers may keep logits past the next step
        return self.static(model, token, input_pos, n_read).clone()

    def report(self) -> dict:
        """{"graphs": (batch, bucket) shapes met (one CUDA graph each), "static_steps", "dynamic_steps",
        "dynamic_caches": why steps were dynamic}."""
        return {"graphs": len(self.shapes), "static_steps": self.static_steps, "dynamic_steps": self.dynamic_steps,
                "dynamic_caches": sorted(self.dynamic_caches)}


def graph_report(decode) -> Optional[dict]:
    """GraphDecode.report() of a decode step that is one (compiled_steps on CUDA), else None."""
    return decode.report() if isinstance(decode, GraphDecode) else None


def prefill_step(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, n_filled: int) -> torch.Tensor:
    """One prefill chunk: tokens [B, T] -> last-position logits [B, V]."""
    return model(tokens, input_pos, last_only=True, n_filled=n_filled)[:, -1]


def chunk_end(done: int, total: int, chunk: int) -> int:
    """Where the prompt chunk starting at token `done` of `total` ends: `chunk` tokens on at most, but a chunk
    after the first never holds one token (model.forward takes such a forward for a decode step), so it may
    hold one more (chunk + 1, or 2 when chunk is 1)."""
    end = min(total, done + max(chunk, 2))
    return total if total - end == 1 else end


def run_prefill(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, prefill=prefill_step,
                chunk: int = 1024) -> torch.Tensor:
    """Feed the whole prompt (tokens, input_pos [B, T]) in chunks (`chunk_end`; in one pass for a policy with
    prefill_in_one_pass) and tell the cache it is complete -> last-position logits [B, V]."""
    T = tokens.shape[1]
    model.cache.before_prefill(input_pos)
    if model.cache.prefill_in_one_pass:  # e.g. compressing policies in engine.generate's batch
        chunk = T
    # each chunk is passed as a tensor of its own, not a view: a compiled step guards on a view's base,
    # so a warm-up prompt sliced from a longer one would make the real prompt recompile
    own = lambda t: t.clone(memory_format=torch.contiguous_format)   # noqa: E731
    s = 0
    while s < T:
        e = chunk_end(s, T, chunk)
        logits = prefill(model, own(tokens[:, s:e]), own(input_pos[:, s:e]), s)
        s = e
    model.cache.end_prefill()
    return logits


def run_decode(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, step: int,
               decode=decode_step) -> torch.Tensor:
    """Decode step number `step` (0 = the first after the prompt): token, input_pos [B, 1] ->
    logits [B, V].  The cache's host hook runs first (the only place a policy may act on the
    host during decode, e.g. trim layers after the first step or pick a step variant).

    CacheFull when the cache already holds max_seq_length tokens: the step's position has no RoPE
    row and an append-only policy (full, snapkv, pyramidkv, a reader over them) no free slot.  The
    check runs here, on the host, so a compiled step is guarded too."""
    check_room(model, step)
    model.cache.before_decode_step(step)
    return decode(model, token, input_pos, model.cache.n_filled)


def check_room(model: Transformer, step: int) -> None:
    """CacheFull unless the cache has room for one more token (see run_decode)."""
    n, capacity = model.cache.n_filled, model.max_seq_length
    if n >= capacity:
        name = getattr(model.cache, "name", type(model.cache).__name__)
        raise CacheFull(f"KV cache full: decode step {step} needs slot {n + 1} but the {name!r} cache was set up "
                        f"for max_seq_length {capacity} (prompt + new tokens); refusing to overwrite it")


_compiled: dict = {}


def compiled_steps(device: torch.device, prefill: bool = False):
    """(prefill, decode) steps with decode compiled once per process (Inductor); the prefill step too with
    prefill=True, else the eager one.  Prefill is compiled only on request: on CPU a compiled prefill ran 1.8x
    slower than eager at 512 tokens and doubled the compile time (docs/results.md section 10).  On CUDA the
    decode step is a GraphDecode: CUDA graphs (mode="reduce-overhead") over caches with a static decode step,
    one per batch size and read bucket, replayed; plain Inductor over the others (their live length is a
    dynamic size: cudagraph trees would record a graph for every length and never replay one)."""
    if device.type not in _compiled:
        # no "duck sizing": two buffers that happen to share a length (a layer's capacity and
        # max_seq_length, say) must not be assumed equal, or the next request recompiles
        torch.fx.experimental._config.use_duck_shape = False
        # the model's floats (norm eps, embedding norm_type) are constants: traced as symbolic inputs,
        # Inductor's scalar pass specializes them and restarts the whole trace (a third of a cold compile)
        torch._dynamo.config.specialize_float = True
        decode = torch.compile(decode_step, dynamic=True)
        if device.type == "cuda":
            decode = GraphDecode(torch.compile(static_decode_step, dynamic=True, mode="reduce-overhead"), decode)
        _compiled[device.type] = {"decode": decode}
    steps = _compiled[device.type]
    if prefill and "prefill" not in steps:
        steps["prefill"] = torch.compile(prefill_step, dynamic=True)
    return steps["prefill"] if prefill else prefill_step, steps["decode"]


def warmup_length(policy=None) -> int:
    """Prompt tokens of the compile warm-up: 4, or 2 G + 1 under KIVI storage, so that no count of key
    groups is 1 there (the compiler specializes dimensions of size 1: the real request would recompile)."""
    return max(4, 2 * (policy.kv_group if policy is not None else 0) + 1)


def warm_up(model: Transformer, prefill, decode, tokens: torch.Tensor, policy=None, steps: int = 3) -> None:
    """Run the compiled steps once on a short prompt (tokens [B, T>=2]) so compilation happens
    before timing; the graphs are dynamic in lengths, so the real request reuses them."""
    B, T = tokens.shape
    # never full (a special shape), and room past a static step's read bound, as a real request has: Dynamo
    # specializes a slice to the whole buffer, so a warm-up that read every slot would recompile for the request
    capacity = max(T + steps + 16, read_bound(T + steps, 1 << 30) + 1)
    model.setup_caches(B, capacity, policy if policy is not None else FullCache())
    pos = torch.arange(T, device=tokens.device).repeat(B, 1)  # made like generate()'s inputs
    with torch.inference_mode():
        run_prefill(model, tokens, pos, prefill)
        # made like decode_loop's inputs: inference tensors, the token a contiguous [B] (at B 1 a clone of
        # the slice would keep its stride T, and the real request's first step would recompile)
        token, next_pos = tokens[:, -1].clone(memory_format=torch.contiguous_format), pos[:, -1:] + 1
        for i in range(steps):
            run_decode(model, token[:, None], next_pos + i, i, decode)

def left_pad(ids: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists of any lengths -> (tokens [B, T], input_pos [B, T]): left-padded with `pad`,
    positions 0.. at each sequence's first real token and -1 on padding."""
    B, T = len(ids), max(len(x) for x in ids)
    tokens = torch.full((B, T), pad, dtype=torch.long)
    input_pos = torch.full((B, T), -1, dtype=torch.long)
    for b, x in enumerate(ids):
        tokens[b, T - len(x):] = torch.tensor(x)
        input_pos[b, T - len(x):] = torch.arange(len(x))
    return tokens.to(device), input_pos.to(device)


def until_eos(row: list[int], tokenizer: Tokenizer) -> list[int]:
    """Generated ids up to (excluding) the first EOS."""
    eos = set(tokenizer.eos_ids)
    return row[:next((j for j, t in enumerate(row) if t in eos), len(row))]
