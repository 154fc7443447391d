"""A context compressed once, asked many questions (the question-agnostic protocol, docs/design.md):
prefill_context compresses it without a question, answer_questions appends each question to a copy of its rows."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from cache.full import FullCache
from model import Transformer
from runtime.stats import GenerationResult, generation_stats
from runtime.steps import Sampler, UsageError, decode_step, prefill_step, run_decode, run_prefill, until_eos
from tokenizer import Tokenizer

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
    new_policy = new_policy or FullCache
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
