"""Generate text with a Llama-family model and a pluggable KV-cache policy.

    python engine.py --checkpoint checkpoints/SmolLM2-135M-Instruct --chat --prompt "Hi"   # printed as generated
    python engine.py --checkpoint checkpoints/SmolLM2-135M-Instruct --interactive          # a chat in the terminal

Run as a script, this sets OMP_WAIT_POLICY=ACTIVE unless you set it: PyTorch's OpenMP
threads otherwise sleep between ops, which costs milliseconds per op on small CPUs.
"""
from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import argparse
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

import torch

from cache import PolicyError, make_policy, policy_names
from cache.kv_dtype import kv_storage
from cache.quantized import GROUP, RESIDUAL, check_format
from checkpoint import WEIGHTS, CheckpointError, build_model, read_checkpoint, release_freed_memory
from model import DenseCache, Transformer
from prefix_cache import PrefixCache, common_prefix
from tokenizer import TextStream, Tokenizer
import tp as tensor_parallel
from tp import TPError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(ValueError):
    """Bad input from the user: reported as a one-line message, never a traceback."""


class CacheFull(ValueError):
    """A decode step past the cache's max_seq_length: refused before anything is written."""


# --------------------------------------------------------------------------- loading

def resolve_device(device: Optional[str]) -> torch.device:
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UsageError(f"unsupported device {device!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA GPU is available")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {device}; use cpu or cuda")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UsageError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise UsageError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(checkpoint, device="cpu", dtype=None, weights: str = "auto", tp: int = 1,
               tp_head: str = "auto") -> tuple[Transformer, Tokenizer]:
    """Load a HuggingFace/converted/quantized directory or a .gguf file -> (model, tokenizer).

    weights="auto": quantized weights run as stored (a `python quantize.py` directory; a GGUF file's
    Q8_0/Q4_0/Q4_1 tensors, repacked without rounding); "float": everything dequantized to `dtype`.
    With tp > 1 (under torchrun) the model is this process's shard (tp.py; TPError for a bad launch or
    head count)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    args, tensors, tokenizer = read_checkpoint(checkpoint, weights)
    args.checkpoint = str(checkpoint)
    tensor_parallel.check(args, tp)        # a bad --tp or launch fails before anything is built
    if tp > 1:
        model = tensor_parallel.build(args, tensors, device, dtype, tp, tp_head)
    else:
        model = build_model(args, tensors, device, dtype, consume=True)
    del tensors
    release_freed_memory()
    return model, tokenizer


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


# --------------------------------------------------------------------------- generation

@dataclass
class GenerationResult:
    texts: list[str]
    tokens: list[list[int]]            # generated ids per sequence, up to (excluding) EOS
    prompt_lengths: list[int]
    stats: dict = field(default_factory=dict)


def decode_step(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, n_filled: int) -> torch.Tensor:
    """One decode forward: token [B, 1] at input_pos [B, 1] -> logits [B, V].

    `n_filled` (the cache's live length) comes in as an argument so `torch.compile` treats it
    as a dynamic int: one compiled graph serves every step."""
    model.cache.n_filled = n_filled
    return model(token, input_pos)[:, -1]


def prefill_step(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, n_filled: int) -> torch.Tensor:
    """One prefill chunk: tokens [B, T] -> last-position logits [B, V]."""
    model.cache.n_filled = n_filled
    return model(tokens, input_pos, last_only=True)[:, -1]


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
    """(prefill, decode) steps with decode compiled once per process (Inductor, on CPU and CUDA); the
    prefill step too with prefill=True, else the eager one.  Prefill is compiled only on request: on CPU
    a compiled prefill ran 1.8x slower than eager at 512 tokens and doubled the compile time
    (docs/results.md section 10).  No CUDA graphs (mode="reduce-overhead"): the live length n_filled is a
    dynamic size, so cudagraph trees record a new graph for every new length and a request never replays
    one (on an H100: no faster than eager; plain Inductor 2.25x faster, docs/results.md section 14)."""
    if device.type not in _compiled:
        # no "duck sizing": two buffers that happen to share a length (a layer's capacity and
        # max_seq_length, say) must not be assumed equal, or the next request recompiles
        torch.fx.experimental._config.use_duck_shape = False
        # the model's floats (norm eps, embedding norm_type) are constants: traced as symbolic inputs,
        # Inductor's scalar pass specializes them and restarts the whole trace (a third of a cold compile)
        torch._dynamo.config.specialize_float = True
        _compiled[device.type] = {"decode": torch.compile(decode_step, dynamic=True)}
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
    model.setup_caches(B, T + steps + 16, policy)  # never full: a full cache is a special shape
    pos = torch.arange(T, device=tokens.device).repeat(B, 1)  # made like generate()'s inputs
    with torch.inference_mode():
        run_prefill(model, tokens, pos, prefill)
        # made like decode_loop's inputs: inference tensors, the token a contiguous [B] (at B 1 a clone of
        # the slice would keep its stride T, and the real request's first step would recompile)
        token, next_pos = tokens[:, -1].clone(memory_format=torch.contiguous_format), pos[:, -1:] + 1
        for i in range(steps):
            run_decode(model, token[:, None], next_pos + i, i, decode)


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence, chat: bool) -> list[list[int]]:
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            if not p.strip():
                raise UsageError("empty prompt")
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = tokenizer.encode(p)
        else:
            ids = list(p)
        if not ids:
            raise UsageError("empty prompt")
        encoded.append(ids)
    return encoded


def check_length(T: int, max_new_tokens: int, max_seq_length: Optional[int], context: int) -> int:
    """The cache length a request of T prompt tokens + max_new_tokens needs (UsageError if it does not fit)."""
    if max_new_tokens < 1:
        raise UsageError("max_new_tokens must be at least 1")
    needed = T + max_new_tokens
    if max_seq_length is not None and needed > max_seq_length:
        raise UsageError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                         f"exceeds --max-seq-length {max_seq_length}")
    max_seq_length = max_seq_length or needed
    if max_seq_length > context:
        raise UsageError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                         f"exceeds the model's context length {context}" if needed > context else
                         f"--max-seq-length {max_seq_length} exceeds the model's context length {context}")
    return max_seq_length


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


def decode_loop(model: Transformer, first: torch.Tensor, pos: torch.Tensor, max_new_tokens: int, sampler: Sampler,
                eos: torch.Tensor, pad: int, decode, stop_check_every: int,
                on_token: Optional[Callable[[torch.Tensor], None]] = None) -> tuple[torch.Tensor, int]:
    """Greedy/sampled decode after the prompt: first [B] (the prefill's token), pos [B, 1] its position
    -> (tokens [B, max_new_tokens] with pad after each sequence's EOS, decode steps run).  A sequence
    stops at its own EOS; the loop ends when all have (checked every `stop_check_every` steps, the
    loop's only host sync).  on_token, if given, gets each step's tokens [B] (first
    included) as they are sampled (reading them is a host sync per step)."""
    B = first.shape[0]
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=first.device)
    out[:, 0] = token = first
    if on_token is not None:
        on_token(token)
    done = torch.isin(token, eos)
    steps = 0
    for i in range(1, max_new_tokens):
        logits = run_decode(model, token[:, None], pos, i - 1, decode)
        token = torch.where(done, pad, sampler(logits))
        out[:, i] = token
        if on_token is not None:
            on_token(token)
        done |= torch.isin(token, eos)
        pos = pos + 1
        steps += 1
        if i % stop_check_every == 0 and bool(done.all()):
            break
    return out, steps


def until_eos(row: list[int], tokenizer: Tokenizer) -> list[int]:
    """Generated ids up to (excluding) the first EOS."""
    eos = set(tokenizer.eos_ids)
    return row[:next((j for j, t in enumerate(row) if t in eos), len(row))]


def generate(model: Transformer, tokenizer: Tokenizer, prompts: Sequence, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             seed: Optional[int] = None, policy=None, max_seq_length: Optional[int] = None,
             chat: bool = False, compile: bool = False, prefill_chunk: int = 1024,
             stop_check_every: int = 8, compile_prefill: bool = False,
             on_token: Optional[Callable[[torch.Tensor], None]] = None,
             context: Optional["Context"] = None) -> GenerationResult:
    """Generate for a batch of prompts (str or token-id lists, any lengths).

    With `context` (from prefill_context) the prompts are questions about that compressed context, each
    appended to a copy of its rows (`answer_questions`; policy, max_seq_length, chat and compile are the
    context's then, and must be left at their defaults).

    Prompts are left-padded to a common length; every sequence keeps its own positions
    (0 at its first real token) and padding is never attended.  Each sequence stops at its
    own EOS; the loop ends when all have (checked every `stop_check_every` steps, the only
    host sync of the decode loop).  `policy` is a cache policy object (DenseCache if None).
    compile=True runs the compiled decode step (`compiled_steps`, warmed up first); compile_prefill=True
    compiles the prefill step as well.  on_token(tokens [B]) is called as each step's tokens are sampled
    (the CLI streams with it: `stream_printer`); after a sequence's EOS its entries are padding.
    """
    if compile_prefill and not compile:
        raise UsageError("compile_prefill needs compile (--compile-prefill needs --compile)")
    if context is not None:
        if policy is not None or max_seq_length is not None or chat or compile:
            raise UsageError("with a context, the policy, max_seq_length and chat template are the context's "
                             "(prefill_context), and compile is not supported")
        return answer_questions(model, tokenizer, context, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                stop_check_every)
    device = model.output.weight.device
    ids = encode_prompts(tokenizer, prompts, chat)
    lengths = [len(x) for x in ids]
    max_seq_length = check_length(max(lengths), max_new_tokens, max_seq_length, model.args.max_position_embeddings)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_ids[0]
    tokens, input_pos = left_pad(ids, pad, device)
    if policy is not None:
        policy.prepare(model, tokenizer)        # calibration files it needs, made on first use
    if compile:
        prefill, decode = compiled_steps(device, compile_prefill)
        warm_up(model, prefill, decode, tokens.new_full((len(ids), warmup_length(policy)), pad), policy)
    else:
        prefill, decode = prefill_step, decode_step
    model.setup_caches(len(ids), max_seq_length, policy)
    sampler = Sampler(temperature, top_k, top_p, torch.Generator(device).manual_seed(seed) if seed is not None else None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        first = sampler(run_prefill(model, tokens, input_pos, prefill, prefill_chunk))
        sync()
        t1 = time.perf_counter()
        out, steps = decode_loop(model, first, input_pos[:, -1:] + 1, max_new_tokens, sampler,
                                 torch.tensor(tokenizer.eos_ids, device=device), pad, decode, stop_check_every,
                                 on_token=on_token)
        sync()
        t2 = time.perf_counter()
    generated = [until_eos(row, tokenizer) for row in out[:, :steps + 1].tolist()]
    stats = generation_stats(model.cache, lengths, steps, t1 - t0, t2 - t1, device)
    return GenerationResult([tokenizer.decode(g) for g in generated], generated, lengths, stats)


# --------------------------------------------------------------------------- a context compressed once

SENTINEL = "\x00BODY\x00"     # where text goes in a chat template's user turn (chat_pieces)


def chat_pieces(tokenizer: Tokenizer, content: str) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the SENTINEL (exactly once in `content`) once `content` is the user turn of the
    checkpoint's chat template with the generation prompt; each piece tokenized on its own, so text put at
    the sentinel is tokenized on its own too (lengths exact by construction)."""
    if content.count(SENTINEL) != 1:
        raise ValueError("the content must hold the sentinel exactly once")
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    before, after = text.split(SENTINEL)
    return tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)


@dataclass
class Context:
    """A context prefilled and compressed once, without any question (the "agnostic" protocol, docs/design.md):
    `generate(..., context=ctx)` appends each question to a copy of its rows.

    ids      the context's tokens: the text's (BOS first if the tokenizer adds one), or with a chat template
             the template up to the first user turn's text, then the text
    suffix   tokens that follow every question given as text: with a chat template the end of the user turn
             and the assistant header, else none
    room     tokens one question (suffix included) and its answer may add: storage holds len(ids) + room
    policy   the one-row policy instance holding the compressed context; never changed after prefill_context
             (a policy that admits whole batches holds nothing: see copies_rows)
    new_policy  makes another instance of the same spec (each question's row)"""
    ids: list[int]
    suffix: list[int]
    room: int
    policy: object
    new_policy: Callable
    prefill_seconds: float

    @property
    def max_seq_length(self) -> int:
        return len(self.ids) + self.room

    @property
    def copies_rows(self) -> bool:
        """True: a question's row is a copy of the context's (the contract's adopt).  False, for a policy that
        admits whole batches (its decisions are per batch, it cannot adopt a row): the context is prefilled
        with each question, in a fresh instance (the same result, without the saving)."""
        return self.policy.admission == "row"


def encode_context(tokenizer: Tokenizer, context, chat: bool) -> tuple[list[int], list[int]]:
    """(Context.ids, Context.suffix) of `context`: text, or token ids used as they are (no suffix)."""
    if not isinstance(context, str):
        ids, suffix = list(context), []
    elif not context.strip():
        raise UsageError("empty context")
    elif chat:
        head, suffix = chat_pieces(tokenizer, SENTINEL)
        ids = head + tokenizer.encode(context, add_special_tokens=False)
    else:
        ids, suffix = tokenizer.encode(context), []
    if not ids:
        raise UsageError("empty context")
    return ids, suffix


def encode_question(tokenizer: Tokenizer, question, ctx: Context) -> list[int]:
    """A question's tokens: its text's (no BOS) then ctx.suffix, or token ids used as they are."""
    if isinstance(question, str):
        if not question.strip():
            raise UsageError("empty question")
        return tokenizer.encode(question, add_special_tokens=False) + ctx.suffix
    if not question:
        raise UsageError("empty question")
    return list(question)


def check_context(n: int, room: int, window: int) -> None:
    """UsageError unless a context of n tokens and `room` more fit the model's window."""
    if room < 1:
        raise UsageError(f"room for a question and its answer must be at least 1 token, got {room}")
    if n >= window:
        raise UsageError(f"context ({n} tokens) is longer than the model's context length {window}")
    if n + room > window:
        raise UsageError(f"context ({n} tokens) + room for a question and its answer ({room}) = {n + room} "
                         f"exceeds the model's context length {window}")


def context_rows(model: Transformer, new_policy: Callable, room: int, max_seq_length: int, batch: int = 1):
    """A fresh instance of the spec with `batch` rows, room for `room` tokens after a prompt, installed as model.cache."""
    policy = new_policy()
    policy.decode_room = room
    return model.setup_caches(batch, max_seq_length, policy)


def prefill_rows(model: Transformer, ids: list[int], prefill_chunk: int) -> float:
    """Prefill ids into model.cache (set up, empty) -> seconds."""
    device = model.output.weight.device
    tokens, pos = torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        run_prefill(model, tokens, pos, prefill_step, prefill_chunk)
        sync()
    return time.perf_counter() - t0


def prefill_context(model: Transformer, tokenizer: Tokenizer, context, new_policy: Optional[Callable] = None,
                    room: int = 512, chat: bool = False, prefill_chunk: int = 1024) -> Context:
    """Prefill and compress `context` (text, or token ids) once, without a question -> Context.

    `new_policy()` makes a fresh policy object of one spec (None: the full cache): the context lives in
    one instance, each question's row in another.  chat=True: the context is the start of the first user
    turn's text and each text question follows it in that turn (Context).  `room`: the tokens one question
    (template end included) and its answer may add."""
    ids, suffix = encode_context(tokenizer, context, chat)
    check_context(len(ids), room, model.args.max_position_embeddings)
    new_policy = new_policy or DenseCache
    new_policy().prepare(model, tokenizer)            # calibration files the policy needs, made on first use
    policy = context_rows(model, new_policy, room, len(ids) + room)
    ctx = Context(ids, suffix, room, policy, new_policy, 0.0)
    if ctx.copies_rows:          # else each question prefills the context (question_rows)
        ctx.prefill_seconds = prefill_rows(model, ids, prefill_chunk)
    return ctx


def append_tokens(model: Transformer, ids: list[int], start: int, decode=decode_step) -> torch.Tensor:
    """Feed ids (a question) to model.cache one decode step each, at positions start.. (decode steps 0..)
    -> logits [1, V] after the last.  Held whole as a question (`hold_questions`): an appending layer keeps
    them all, an evicting one takes its victims from the context meanwhile."""
    hold_questions(model.cache, start, [ids])
    device = model.output.weight.device
    tokens = torch.tensor(ids, device=device)[None]
    pos = torch.arange(start, start + len(ids), device=device)[None]
    for i in range(len(ids)):
        logits = run_decode(model, tokens[:, i:i + 1], pos[:, i:i + 1], i, decode)
    return logits


def question_rows(model: Transformer, ctx: Context, batch: int = 1):
    """model.cache with `batch` rows, each a copy of ctx's compressed context (the contract's adopt of its
    row 0) -> that policy.  A policy that cannot adopt rows (ctx.copies_rows False) takes one row, and a fresh
    instance prefills ctx.ids."""
    if not ctx.copies_rows:
        if batch != 1:
            raise ValueError(f"{ctx.policy.name} admits whole batches: its context's questions go one at a time")
        context_rows(model, ctx.new_policy, ctx.room, ctx.max_seq_length)
        prefill_rows(model, ctx.ids, 1024)
        return model.cache
    rows = context_rows(model, ctx.new_policy, ctx.room, ctx.max_seq_length, batch)
    for row in range(batch):
        rows.adopt(row, ctx.policy)
    return rows


def hold_questions(cache, start: int, questions: list[list[int]]) -> None:
    """Row r of `cache` appends questions[r] at positions start..: held whole until its first answer token (the
    contract's hold_question; UsageError when a question is longer than the row can hold)."""
    for row, q in enumerate(questions):
        try:
            cache.hold_question(row, start, start + len(q))
        except ValueError as e:
            raise UsageError(str(e)) from None


def answer_questions(model: Transformer, tokenizer: Tokenizer, ctx: Context, questions: Sequence,
                     max_new_tokens: int = 64, temperature: float = 0.0, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, seed: Optional[int] = None, stop_check_every: int = 8,
                     batch: int = 8) -> GenerationResult:
    """Answer the questions (text, or token ids) about ctx, up to `batch` at once, one row each (`answer_rows`;
    a policy that cannot copy rows: one at a time, its context prefilled with each).  Greedy answers equal
    those of each question asked alone; sampled ones draw from one generator per group (seeded by `seed`).
    Stats as `generate`'s with prefill_* the steps until every question is in, decode_* the rest; context_*
    the context's one prefill; context_prefills_again the questions that prefilled the context themselves;
    questions_seconds the whole call."""
    if max_new_tokens < 1 or batch < 1:
        raise UsageError("max_new_tokens and batch must be at least 1")
    ids = [encode_question(tokenizer, q, ctx) for q in questions]
    if not ids:
        raise UsageError("give at least one question")
    for q in ids:
        if len(q) + max_new_tokens > ctx.room:
            raise UsageError(f"question ({len(q)} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{len(q) + max_new_tokens} exceeds the context's room {ctx.room} (prefill_context room=)")
    device = model.output.weight.device
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    Sampler(**sampling)                                  # bad settings fail before any work
    batch = batch if ctx.copies_rows else 1
    t_start, generated, totals = time.perf_counter(), [], [0, 0.0, 0.0]
    with torch.inference_mode():
        for g in range(0, len(ids), batch):
            group = ids[g:g + batch]
            hold_questions(question_rows(model, ctx, len(group)), len(ctx.ids), group)
            generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
            answers, *cost = answer_rows(model, tokenizer, len(ctx.ids), group, max_new_tokens,
                                         Sampler(**sampling, generator=generator), stop_check_every)
            generated += answers
            totals = [a + b for a, b in zip(totals, cost)]
    steps, question_s, decode_s = totals
    stats = generation_stats(model.cache, [len(q) for q in ids], steps, question_s, decode_s, device)
    stats.update(batch_size=min(batch, len(ids)), context_tokens=len(ctx.ids), context_prefill_seconds=ctx.prefill_seconds,
                 context_prefills_again=0 if ctx.copies_rows else len(ids),
                 questions_seconds=time.perf_counter() - t_start)
    return GenerationResult([tokenizer.decode(g) for g in generated], generated, [len(q) for q in ids], stats)


def answer_rows(model: Transformer, tokenizer: Tokenizer, start: int, questions: list[list[int]],
                max_new_tokens: int, sampler: Sampler, stop_check_every: int) -> tuple[list[list[int]], int, float, float]:
    """Every row of model.cache holds a context of `start` tokens: row r gets questions[r].  Decode step i feeds
    every row the token at position start + i: its question's token while it has one, then its sampled answer
    token (pad after its EOS), so row r's answer token j is sampled at step len(q_r) - 1 + j.  The policy's
    decode rule applies to question and answer tokens alike, except that a question held by `hold_questions`
    is not evicted before its row's first answer token -> (answers up to EOS, decode steps, seconds until the
    longest question is in, seconds after)."""
    device = model.output.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_ids[0]
    B, L = len(questions), max(len(q) for q in questions)
    forced = torch.tensor([q + [pad] * (L - len(q)) for q in questions], device=device)        # [B, L]
    qlen = torch.tensor([len(q) for q in questions], device=device)
    eos, rows = torch.tensor(tokenizer.eos_ids, device=device), torch.arange(B, device=device)
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    token, pos = forced[:, 0], torch.full((B, 1), start, device=device)
    sync()
    t0 = t1 = time.perf_counter()
    for i in range(L + max_new_tokens - 1):
        logits = run_decode(model, token[:, None], pos + i, i, decode_step)
        j = i + 1 - qlen                                    # the answer token each row samples now
        answering = (j >= 0) & (j < max_new_tokens) & ~done
        sampled = torch.where(answering, sampler(logits), pad)
        at = j.clamp(0, max_new_tokens - 1)
        out[rows, at] = torch.where(answering, sampled, out[rows, at])
        done |= answering & torch.isin(sampled, eos)
        token = torch.where(i + 1 < qlen, forced[:, min(i + 1, L - 1)], sampled)
        if i == L - 1:
            sync()
            t1 = time.perf_counter()
        if i >= L - 1 and (i + 1) % stop_check_every == 0 and bool((done | (j >= max_new_tokens - 1)).all()):
            break
    sync()
    return [until_eos(row, tokenizer) for row in out.tolist()], i + 1, t1 - t0, time.perf_counter() - t1


@dataclass(eq=False)
class Pending:
    """A request being admitted (RowBatch.start): its prompt and how far its prefill has come."""
    ids: list[int]
    row: int                            # the row it takes once its prompt is prefilled
    prefix_len: Optional[int] = None    # where a shared prefix ends, when the caller knows (prefix_cache.py)
    done: int = 0                       # prompt tokens in the scratch so far (reused ones included)
    reused: int = 0                     # prompt tokens copied from a kept prefix
    snapshot_at: int = 0                # keep the prefix of this many tokens when the prefill reaches it (0: none)
    started: bool = False
    new_tokens: Optional[int] = None    # tokens it may generate (None: max_new_tokens): what its row must hold
    protocol: str = "aware"             # how its prompt is held: "exact", "aware" or "agnostic" (RowBatch)
    question: list[int] = field(default_factory=list)   # agnostic: prompt tokens still to append, one a step
    kept: Optional[object] = None       # exact: the kept prefix its prompt starts with (reused or snapshotted)


class RowBatch:
    """A running batch that requests join and leave (continuous batching; cache/contract.py, "admission").

    A policy with admission "row" takes requests one at a time: each prompt is prefilled alone in a one-row
    instance of the policy (`scratch`), then moved into a free row (`policy.adopt`) while the other rows keep
    their state.  Admission is staged: `start` queues a request (it reserves a row), each `advance` runs one
    prefill chunk (at most prefill_chunk tokens, `chunk_end`; a compressing policy stages the chunks and
    compresses the prompt with the last, cache/base.py) of the oldest one, so a server alternates one chunk
    with one decode `step` of the running rows and a long prompt never stalls them for its whole length.
    `admit` is start + advance until done.  Every `step` decodes all rows together, each at its own position;
    free rows ride along at position -1 and nothing of theirs is read or kept.  A policy with admission
    "batch" makes decisions for the whole batch (layer budgets, sharing configurations), so requests start
    only in an empty batch, all those started together prefilled as one left-padded batch by one advance (as
    `generate` does).  Storage is fixed when the batch is made: a policy with `ratio=` (its budget a share of
    each prompt) holds in every row the budget of a max_seq_length-token prompt, and each request resolves its
    own, smaller or equal, at admission.

    prefix_bytes > 0 keeps prefilled prefixes (prefix_cache.py) when the policy declares prefix_reuse: a prompt
    starting with a kept prefix prefills only the rest, exactly (protocol "exact").  With agnostic=True a policy
    without prefix_reuse that admits rows keeps compressed prefixes instead (the question-agnostic protocol of
    `prefill_context` / `generate(context=)`): a shared prefix is prefilled and compressed once alone, a prompt
    starting with it has its row adopt it and appends the rest of its prompt one decode step each (`step` feeds
    them; `joined` lists the rows whose prompt the latest step completed), protocol "agnostic"; where its
    question and answer do not fit a row's room (max_new_tokens), its whole prompt is prefilled ("aware").
    `reuse_off` says why a batch keeps no prefixes.  With share_prefix (exact reuse; off for a compiled decode
    step, which would recompile when rows start and stop sharing) a request's row reads the kept prefix its
    prompt started with in place instead of a copy (DenseCache.adopt(prefix=)): many questions about one
    document read its K/V once per step for all their rows.

        batch = RowBatch(model, lambda: make_policy("snapkv"), max_batch=8, max_seq_length=4096, max_new_tokens=256)
        p = batch.start(ids)                    # while batch.room > 0
        for row, logits in batch.advance():     # one prefill chunk; requests whose prompt is complete, logits [V]
            ...
        logits = batch.step({row: token})       # [B, V]: one decode step of every active row
        batch.release(row)                      # the request is done: its row is free
    """

    def __init__(self, model: Transformer, make_policy, max_batch: int, max_seq_length: int, max_new_tokens: int,
                 prefill=prefill_step, decode=decode_step, prefill_chunk: int = 1024, prefix_bytes: int = 0,
                 min_prefix: int = 32, agnostic: bool = False, share_prefix: bool = True):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.model, self.make_policy, self.max_batch = model, make_policy, max_batch
        self.max_seq_length, self.max_new_tokens = max_seq_length, max_new_tokens
        self.prefill, self.decode, self.prefill_chunk = prefill, decode, prefill_chunk
        self.share_prefix = share_prefix
        self.policy, self.scratch = make_policy(), make_policy()
        for policy in (self.scratch, self.policy):     # storage for prompt + max_new_tokens, fixed at setup
            policy.decode_room = max_new_tokens
            model.setup_caches(1 if policy is self.scratch else max_batch, max_seq_length, policy)
        self.rows = self.policy.admission == "row"     # (known once set up: e.g. ds's channel source)
        if not self.rows:
            self.scratch = None
        self.next_pos = [-1] * max_batch      # each row's next position (-1: free)
        self.batch_size = max_batch           # rows of the policy's storage (batch admission: the group's)
        self.steps = 0                        # decode steps since the batch was last empty
        self.pending: list[Pending] = []      # started, not yet admitted (oldest first)
        self.prefill_since_step = 0           # prompt tokens prefilled while active rows waited for their next step
        self.prefill_tokens = 0               # prompt tokens prefilled in all (prefix reuse: less than prompted)
        self.appending: dict[int, Pending] = {}   # agnostic: rows appending the rest of their prompt
        self.joined: list[int] = []           # rows whose prompt the latest step completed (their logits are its last)
        self.agnostic = agnostic and self.rows and not self.policy.prefix_reuse
        self.prefixes, self.reuse_off = None, None
        if prefix_bytes and self.rows and (self.policy.prefix_reuse or self.agnostic):
            self.prefixes = PrefixCache(prefix_bytes, min_prefix)
        elif prefix_bytes:
            self.reuse_off = (f"policy {self.policy.name!r} keeps no prefixes: it cannot continue a prefilled prefix "
                              f"exactly (prefix_reuse, cache/contract.py), and " +
                              ("admits whole batches" if not self.rows else "agnostic reuse is off"))

    @property
    def active(self) -> list[int]:
        return [r for r, p in enumerate(self.next_pos) if p >= 0]

    @property
    def room(self) -> int:
        """Requests that can start now."""
        if self.rows:
            return sum(p < 0 for p in self.next_pos) - len(self.pending)
        return 0 if self.active else self.max_batch - len(self.pending)

    def start(self, ids: list[int], prefix_len: Optional[int] = None, new_tokens: Optional[int] = None) -> Pending:
        """Queue the request `ids` (token ids; prefix_len: where a prefix shared with other requests ends, if
        known; new_tokens: the most it may generate, default max_new_tokens) for admission -> its Pending,
        holding the row it will take.  ValueError when none is free."""
        if not ids:
            raise ValueError("empty prompt")
        if self.room < 1:
            raise ValueError("no room to start a request now (batch.room is 0)")
        taken = {p.row for p in self.pending}
        row = next(r for r in range(self.max_batch) if self.next_pos[r] < 0 and r not in taken)
        protocol = "exact" if self.policy.prefix_reuse else "aware"
        self._snapshot_for(ids)
        self.pending.append(Pending(list(ids), row, prefix_len, new_tokens=new_tokens, protocol=protocol))
        return self.pending[-1]

    def _snapshot_for(self, ids: list[int]) -> None:
        """A request starting while the oldest one's prompt is being prefilled (exact reuse): where they share a
        prefix the prefill has not yet passed, none is planned, and it is at least min_prefix tokens longer
        than the kept one that prompt started from, that prefill snapshots it, as if
        this request had been waiting when it began (prefix_cache.py, boundary); else this request would
        prefill the shared prefix again."""
        p = self.pending[0] if self.pending and self.prefixes is not None and not self.agnostic else None
        if p is None or not p.started or p.snapshot_at:
            return
        n = min(common_prefix(p.ids, ids), len(p.ids) - 1)
        if n - p.reused >= self.prefixes.min_tokens and n > p.done and tuple(p.ids[:n]) not in self.prefixes.entries:
            p.snapshot_at = n

    def cancel(self, pending: Pending) -> None:
        """Drop a started request before its prompt is complete (its client left); its row is free again."""
        if pending in self.pending:
            self.pending.remove(pending)
        else:
            self.release(pending.row)               # an agnostic one appending its question

    def holds(self, pending: Pending) -> bool:
        """Whether a started request's prompt is still being admitted (False once complete, cancelled or dropped
        by a failed `advance`)."""
        return pending in self.pending or self.appending.get(pending.row) is pending

    def advance(self) -> list[tuple[int, torch.Tensor]]:
        """One admission step: a prefill chunk of the oldest pending request (admission "row"), or every
        pending request's prefill (admission "batch") -> [(row, logits [V] of the prompt's last position)] of
        the requests whose prefill is now complete: they decode from the next step.  A failure drops the
        request it happened in (the whole group under admission "batch"; `holds` tells) and is re-raised."""
        if not self.pending:
            return []
        if not self.rows:
            return self._prefill_group()
        p = self.pending[0]
        try:
            context = self._context(p) if self.agnostic and self.prefixes is not None and not p.started else None
            logits = None if context is not None else self._chunk(p)
        except BaseException:
            self.pending.remove(p)
            raise
        if context is None and logits is None:
            return []
        self.pending.remove(p)
        if not self.active:
            self.steps = 0
        if context is None and self.share_prefix and p.kept is not None:    # its row reads the prefix in place
            self.policy.adopt(p.row, self.scratch, prefix=p.kept)
        else:
            self.policy.adopt(p.row, self.scratch if context is None else context)
        self.next_pos[p.row] = p.done
        if context is not None:
            self.policy.hold_question(p.row, p.done, len(p.ids))
            self.appending[p.row] = p
            return []
        return [(p.row, logits)]

    def _context(self, p: Pending):
        """The agnostic protocol for p: a kept compressed prefix of its prompt, or one it shares with others (the
        same boundary as exact reuse), compressed now -> that one-row instance, p.question the rest of its prompt,
        held whole until p's answer starts (the contract's hold_question); None where none is shared, the rest and
        p's answer would not fit a row's room (decode_room), or the rest is longer than the context's
        question_room."""
        room = self.max_new_tokens - (self.max_new_tokens if p.new_tokens is None else p.new_tokens)
        shortest = max(len(p.ids) - room, 1)
        n, context = self.prefixes.lookup(p.ids, shortest)
        at = self.prefixes.boundary(p.ids, [q.ids for q in self.pending if q is not p], p.prefix_len)
        reused = n
        if context is None and at >= shortest:
            n, context, reused = at, self._compress(p.ids[:at]), 0
        held = None if context is None else context.question_room(0)
        if context is None or (held is not None and len(p.ids) - n > held):
            return None                     # (a context compressed now stays kept for the next request)
        p.started, p.done, p.protocol, p.question, p.reused = True, n, "agnostic", p.ids[n:], reused
        return context

    def _compress(self, ids: list[int]):
        """ids prefilled and compressed alone in a one-row instance set up as the rows are (prefill_context's
        steps), kept in the prefix LRU -> that instance."""
        try:
            context = context_rows(self.model, self.make_policy, self.max_new_tokens, self.max_seq_length)
            prefill_rows(self.model, ids, self.prefill_chunk)
        finally:
            self.model.cache = self.policy
        self.count_prefill(len(ids))
        self.prefixes.insert(tuple(ids), context, context.kv_bytes()["allocated"])
        return context

    def admit(self, requests: Sequence[list[int]]) -> list[tuple[int, torch.Tensor]]:
        """Admit the first of `requests` (token-id lists) that fit now -> [(row, logits [V] of the prompt's
        last position)]; the others must wait (no free row, or a batch-admission policy still running)."""
        if self.pending:
            raise ValueError("admit needs no staged request pending (finish those with advance)")
        started = [self.start(ids) for ids in requests[:max(self.room, 0)]]
        done: dict = {}
        while self.pending:
            done.update(self.advance())
        return [(p.row, done[p.row]) for p in started]

    def _prefill_group(self) -> list[tuple[int, torch.Tensor]]:
        """Admission "batch": every pending request as one left-padded batch in an empty batch."""
        group, self.pending = [p.ids for p in self.pending], []
        self.count_prefill(sum(len(ids) for ids in group))
        tokens, input_pos = left_pad(group, 0, self.model.output.weight.device)
        self.model.setup_caches(len(group), self.max_seq_length, self.policy)
        self.batch_size = len(group)
        self.next_pos = [len(ids) for ids in group] + [-1] * (self.max_batch - len(group))
        self.steps = 0
        try:
            logits = run_prefill(self.model, tokens, input_pos, self.prefill, self.prefill_chunk)
        except BaseException:
            self.next_pos = [-1] * self.max_batch       # the group is dropped: the batch is empty again
            raise
        return list(enumerate(logits))

    def count_prefill(self, n: int) -> None:
        self.prefill_tokens += n
        self.prefill_since_step = self.prefill_since_step + n if self.active else 0   # (no row waits)

    def _chunk(self, p: Pending) -> Optional[torch.Tensor]:
        """Prefill the next chunk of p's prompt in the scratch -> logits [V] of the prompt's last position
        once it is complete, else None."""
        model, device = self.model, self.model.output.weight.device
        model.cache = self.scratch
        try:
            if not p.started:
                self._begin(p)
            end = len(p.ids) if self.scratch.prefill_in_one_pass else chunk_end(p.done, len(p.ids), self.prefill_chunk)
            end = min(end, p.snapshot_at) if p.done < p.snapshot_at else end
            tokens = torch.tensor([p.ids[p.done:end]], device=device)
            logits = self.prefill(model, tokens, torch.arange(p.done, end, device=device)[None], p.done)
            self.count_prefill(end - p.done)
            p.done = end
            if end == p.snapshot_at:
                self._snapshot(p)
            if end < len(p.ids):
                return None
            self.scratch.end_prefill()
            return logits[0]
        finally:
            model.cache = self.policy

    def _begin(self, p: Pending) -> None:
        """The scratch starts p's prompt: from the longest kept prefix of it, if any; fixes where to snapshot."""
        self.scratch.reset()
        if self.prefixes is not None and not self.agnostic:
            n, snapshot = self.prefixes.lookup(p.ids)
            if snapshot is not None:
                self.scratch.adopt(0, snapshot)
                p.done = p.reused = n
                p.kept = snapshot
            at = self.prefixes.boundary(p.ids, [q.ids for q in self.pending if q is not p], p.prefix_len)
            p.snapshot_at = at if at > p.done else 0
        device = self.model.output.weight.device
        self.scratch.before_prefill(torch.arange(p.done, len(p.ids), device=device)[None])
        p.started = True

    def _snapshot(self, p: Pending) -> None:
        """Keep the scratch's first p.done tokens as a prefix: a one-row instance sized to them."""
        snapshot, weight = self.make_policy(), self.model.norm.weight
        snapshot.decode_room = self.max_new_tokens
        snapshot.setup(self.model.args, 1, p.done, weight.dtype, weight.device)
        snapshot.adopt(0, self.scratch)
        self.prefixes.insert(tuple(p.ids[:p.done]), snapshot, snapshot.kv_bytes()["allocated"])
        p.kept = snapshot

    def step(self, tokens: dict[int, int]) -> torch.Tensor:
        """One decode step: tokens {row: the token at the row's next position} for every active row but those
        appending their prompt (fed its next token here) -> logits [B, V] (rows not given are free, or append:
        their logits mean nothing, but for the rows in `joined`, whose prompt is now complete)."""
        answering = [r for r in self.active if r not in self.appending]
        if sorted(tokens) != answering:
            raise ValueError(f"step needs one token for each active row {answering}, got rows {sorted(tokens)}")
        tokens = {**tokens, **{row: p.question[0] for row, p in self.appending.items()}}
        device = self.model.output.weight.device
        token = torch.zeros(self.batch_size, 1, dtype=torch.long)
        pos = torch.full((self.batch_size, 1), -1, dtype=torch.long)
        for row, t in tokens.items():
            token[row, 0], pos[row, 0] = t, self.next_pos[row]
        logits = run_decode(self.model, token.to(device), pos.to(device), self.steps, self.decode)
        for row in tokens:
            self.next_pos[row] += 1
        self.joined = []
        for row, p in list(self.appending.items()):
            del p.question[0]
            if not p.question:
                del self.appending[row]
                self.joined.append(row)
        self.steps += 1
        self.prefill_since_step = 0
        return logits

    def release(self, row: int) -> None:
        """The request in `row` is done (finished or abandoned): the row is free for the next one."""
        if self.next_pos[row] < 0:
            raise ValueError(f"row {row} holds no request")
        self.next_pos[row] = -1
        self.appending.pop(row, None)
        if self.rows:
            self.policy.release(row)


def generation_stats(cache, lengths: list[int], steps: int, prefill_s: float, decode_s: float, device) -> dict:
    B, kv = len(lengths), cache.kv_bytes()
    return {
        "batch_size": B,
        "prompt_tokens": lengths,
        "prefill_seconds": prefill_s,
        "prefill_tokens_per_s": sum(lengths) / prefill_s,
        "decode_steps": steps,
        "decode_seconds": decode_s,
        "decode_tokens_per_s_per_seq": steps / decode_s if steps else float("nan"),
        "decode_tokens_per_s": B * steps / decode_s if steps else float("nan"),
        "kv_bytes_allocated": kv["allocated"],
        "kv_bytes_live": kv["live"],
        "peak_memory_bytes": peak_memory_bytes(device),
        "policy": cache.describe(),
    }


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA allocation, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def format_stats(s: dict) -> str:
    return (f"prompt tokens {s['prompt_tokens']} | prefill {s['prefill_tokens_per_s']:.1f} tok/s | "
            f"decode {s['decode_tokens_per_s_per_seq']:.2f} tok/s/seq, {s['decode_tokens_per_s']:.2f} tok/s "
            f"aggregate ({s['decode_steps']} steps) | KV cache {format_bytes(s['kv_bytes_allocated'])} allocated, "
            f"{format_bytes(s['kv_bytes_live'])} live | peak memory {format_bytes(s['peak_memory_bytes'])}")


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch of different prompts)")
    p.add_argument("--prompt-file", action="append", help="file whose whole text is one prompt (repeatable)")
    p.add_argument("--context-file", help="compress this file's text once, without the question (the agnostic protocol), "
                                          "then answer each --prompt about it (with --chat: the text opens the user "
                                          "turn and each question follows it)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--interactive", action="store_true",
                   help="a multi-turn chat in the terminal: each line read is a user turn, answered with the "
                        "checkpoint's chat template (the whole conversation is prefilled each turn); "
                        "/reset forgets it, /exit or end of input ends")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, help="default: the number of prompts; a single prompt is repeated")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="auto: quantized checkpoints (quantize.py output; GGUF Q8_0/Q4_0/Q4_1) run from their own "
                        "int8/int4 weights; float: dequantize them to --dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile-prefill", action="store_true",
                   help="with --compile, the prefill step too (on CPU eager prefill is faster)")
    p.add_argument("--max-seq-length", type=int, help="cache length (prompt + new tokens); default: just enough")
    p.add_argument("--policy", default="full", help=f"KV-cache policy spec NAME[:key=value,...], e.g. snapkv:budget=128, "
                                                    f"snapkv:ratio=0.5 (half the prompt removed) or "
                                                    f"snapkv+hshare:preset=short; NAME one of {', '.join(policy_names())}")
    p.add_argument("--policy-args", default="", help="more policy parameters, k=v,k=v (--policy X --policy-args k=v "
                                                     "is the same as --policy X:k=v)")
    add_kv_flags(p)
    add_tp_flags(p)
    return p


def add_tp_flags(p: argparse.ArgumentParser) -> None:
    """--tp / --tp-head (the benchmark takes them too)."""
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism over N processes, sharded by KV head: "
                                                     "launch with torchrun --nproc-per-node N (tp.py)")
    p.add_argument("--tp-head", choices=tensor_parallel.HEADS, default="auto",
                   help="output head under --tp: vocab (each process its vocabulary slice, logits all-gathered), "
                        "replicated, or auto (default: vocab on CUDA, replicated on CPU)")


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """--kv-bits / --kv-dtype / --kv-group-size / --kv-residual (the evals and the benchmark take them too)."""
    p.add_argument("--kv-bits", type=int, default=16, choices=[32, 16, 4, 2],
                   help="KV storage bits: 16 = unquantized in --kv-dtype (default: the compute dtype), 32 = float32 "
                        "(full), 4 or 2 = KIVI-packed (any policy but pod; sparse readers read packed storage)")
    p.add_argument("--kv-dtype", choices=["bfloat16", "float16", "float32"],
                   help="storage dtype of the unquantized `full` cache (default: the compute dtype); attention "
                        "computes in the compute dtype")
    p.add_argument("--kv-group-size", type=int, default=GROUP, help="KIVI group G: keys per channel over G tokens, "
                                                                 "values per token over G channels (default 32)")
    p.add_argument("--kv-residual", type=int, default=RESIDUAL,
                   help=f"KIVI residual R (a multiple of G; default {RESIDUAL}): keys are quantized R at a time, "
                        f"the n mod R newest stay in full precision; values keep a FIFO of the newest R")


def kv_policy(policy, args):
    """The policy with --kv-bits/--kv-dtype/--kv-group-size/--kv-residual applied (UsageError for bad values
    or a policy without that storage).  A storage dtype equal to the compute dtype (--dtype on --device)
    is the policy as it is, so --kv-bits 32 on a float32 model changes nothing."""
    compute = resolve_dtype(args.dtype, resolve_device(args.device))
    try:
        return kv_storage(policy, args.kv_bits, args.kv_group_size, args.kv_residual, args.kv_dtype, compute)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_kv_fits(args, model_args) -> None:
    """UsageError unless the model's head_dim suits --kv-group-size (and the packing) at --kv-bits."""
    if args.kv_bits not in (32, 16):
        try:
            check_format(model_args.head_dim, args.kv_bits, args.kv_group_size, args.kv_residual)
        except ValueError as e:
            raise UsageError(str(e)) from None


def collect_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    for f in args.prompt_file or []:
        try:
            prompts.append(Path(f).read_text())
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file {f}: {e.strerror}") from e
    if not prompts:
        raise UsageError("give a prompt with --prompt or --prompt-file")
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt")
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UsageError("--batch-size must be at least 1")
        if len(prompts) == 1:
            prompts = prompts * args.batch_size
        elif len(prompts) != args.batch_size:
            raise UsageError(f"--batch-size {args.batch_size} does not match the {len(prompts)} prompts given")
    return prompts


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_cli(args)
    except (UsageError, CheckpointError, PolicyError, TPError, FileNotFoundError) as e:
        return tensor_parallel.fail(str(e))      # under --tp every process meets the same error
    finally:
        tensor_parallel.finish()


def run_cli(args: argparse.Namespace) -> int:
    """main() after parsing: generate, then print (rank 0 only under --tp).  A single sequence is printed as
    it is generated; a batch once it is done, each text after a `--- [i]` line."""
    if args.compile_prefill and not args.compile:
        raise UsageError("--compile-prefill needs --compile")
    if args.interactive and (args.prompt or args.prompt_file or args.batch_size or args.tp > 1):
        raise UsageError("--interactive reads its prompts from the terminal, one sequence in one process: "
                         "drop --prompt/--prompt-file/--batch-size/--tp")
    prompts = [] if args.interactive else collect_prompts(args)
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    Sampler(args.temperature, args.top_k, args.top_p)            # bad sampling flags fail before loading
    policy = kv_policy(make_policy(args.policy, args.policy_args), args)
    context = read_context(args)
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.checkpoint, device, args.dtype, args.weights, args.tp, args.tp_head)
    check_kv_fits(args, model.args)
    if args.interactive:
        return chat_loop(model, tokenizer, policy, args, sys.stdin, sys.stdout)
    seed = args.seed
    if seed is None and model.args.shard is not None:             # every process must sample alike
        seed = model.args.shard.shared_seed()
    streamed = context is None and len(prompts) == 1 and tensor_parallel.is_leader()
    on_token, stream = stream_printer(tokenizer, sys.stdout) if streamed else (None, None)
    if context is not None:
        result = answer_cli(args, model, tokenizer, context, prompts, seed)
    else:
        result = generate(model, tokenizer, prompts, args.max_new_tokens, args.temperature, args.top_k,
                          args.top_p, seed, policy, args.max_seq_length, args.chat, args.compile,
                          compile_prefill=args.compile_prefill, on_token=on_token)
    if not tensor_parallel.is_leader():
        return 0
    if streamed:
        print(stream.flush(), flush=True)
    for i, text in enumerate(result.texts if len(result.texts) > 1 else []):
        print(f"--- [{i}]")
        print(text)
    print(format_stats(result.stats), file=sys.stderr)
    if context is not None:
        s = result.stats
        print(f"context {s['context_tokens']} tokens prefilled once in {s['context_prefill_seconds']:.2f} s "
              f"({s['context_prefills_again']} prefilled again); {len(prompts)} questions answered in "
              f"{s['questions_seconds']:.2f} s", file=sys.stderr)
    return 0


def stream_printer(tokenizer: Tokenizer, out: TextIO) -> tuple[Callable[[torch.Tensor], None], TextStream]:
    """(on_token for generate, its TextStream): writes the first sequence's text to `out` as it is generated
    (flushed, a partial character held back), up to its EOS; `stream.flush()` is what is left to print."""
    stream, eos, ended = TextStream(tokenizer), set(tokenizer.eos_ids), []

    def on_token(tokens: torch.Tensor) -> None:
        token = int(tokens[0])
        if ended or token in eos:
            ended.append(True)
            return
        out.write(stream.push(token))
        out.flush()
    return on_token, stream


def chat_loop(model: Transformer, tokenizer: Tokenizer, policy, args, lines: TextIO, out: TextIO) -> int:
    """--interactive: each line of `lines` is a user turn; the answer (generate on the whole conversation in the
    chat template, streamed) goes to `out`, one line per answer; the prompt "> " goes to stderr.  A turn that
    does not fit the context is refused with a message and forgotten."""
    if tokenizer.chat_template is None:
        raise UsageError(f"--interactive needs a chat template; {args.checkpoint} has none")
    messages = []
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                               add_special_tokens=False)
        on_token, stream = stream_printer(tokenizer, out)
        try:
            result = generate(model, tokenizer, [ids], args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                              args.seed, policy, args.max_seq_length, compile=args.compile, on_token=on_token)
        except UsageError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print(stream.flush(), file=out, flush=True)
        messages.append({"role": "assistant", "content": result.texts[0]})


def read_context(args) -> Optional[str]:
    """--context-file's text (None without it); UsageError for flags that do not apply to it."""
    if not args.context_file:
        return None
    for flag, value in (("--batch-size", args.batch_size), ("--max-seq-length", args.max_seq_length),
                        ("--compile", args.compile or None), ("--tp", args.tp if args.tp > 1 else None)):
        if value is not None:
            raise UsageError(f"{flag} does not apply with --context-file")
    try:
        text = Path(args.context_file).read_text()
    except OSError as e:
        raise UsageError(f"cannot read --context-file {args.context_file}: {e.strerror}") from None
    if not text.strip():
        raise UsageError(f"--context-file {args.context_file} is empty")
    return text


def answer_cli(args, model: Transformer, tokenizer: Tokenizer, text: str, questions: list[str],
               seed: Optional[int]) -> GenerationResult:
    """Compress the context once (room for the longest question + --max-new-tokens), then answer each question."""
    new_policy = lambda: kv_policy(make_policy(args.policy, args.policy_args), args)   # noqa: E731
    suffix = chat_pieces(tokenizer, SENTINEL)[1] if args.chat else []
    longest = max(len(tokenizer.encode(q, add_special_tokens=False)) for q in questions) + len(suffix)
    ctx = prefill_context(model, tokenizer, text, new_policy, longest + args.max_new_tokens, args.chat)
    return generate(model, tokenizer, questions, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    seed, context=ctx)


if __name__ == "__main__":
    sys.exit(main())
