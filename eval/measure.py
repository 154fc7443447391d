"""What an eval's requests cost, measured the same way for every task: KV bytes from the
policy's own `kv_bytes()` and decode steps/seconds, summed over a task's requests.

`generate` runs one greedy request through `engine.generate`; `forced_logits` prefills a
prompt and teacher-forces given tokens one decode step at a time (perplexity, agreement),
returning the logits of every step.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

import engine
from cache.full import FullCache
from runtime.context import prefill_context
from runtime.steps import UsageError, decode_step, prefill_step, run_decode, run_prefill


@dataclass
class Usage:
    """Sums over a task's requests."""
    requests: int = 0
    prompt_tokens: int = 0
    kv_allocated: int = 0          # bytes the policy allocated (per request, summed)
    kv_live: int = 0               # bytes holding tokens at the end of the request
    kv_read: int = 0               # bytes one decode step reads at the end of the request
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0

    def add(self, policy, prompt_tokens: int, decode_steps: int, decode_seconds: float,
            prefill_seconds: float) -> None:
        kv = policy.kv_bytes()
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.kv_allocated += int(kv["allocated"])
        self.kv_live += int(kv["live"])
        self.kv_read += int(kv.get("read_per_step", kv["live"]))
        self.decode_steps += decode_steps
        self.decode_seconds += decode_seconds
        self.prefill_seconds += prefill_seconds

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else None

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s}


def generate(loaded, policy, ids: list[int], max_new_tokens: int, usage: Optional[Usage] = None,
             compile: bool = False) -> str:
    """Greedy answer to one prompt (ids) with `policy` active; its cost goes to `usage`."""
    result = engine.generate(loaded.model, loaded.tokenizer, [ids], max_new_tokens, policy=policy, compile=compile)
    if usage is not None:
        s = result.stats
        usage.add(policy, len(ids), s["decode_steps"], s["decode_seconds"], s["prefill_seconds"])
    return result.texts[0].strip()


PROTOCOLS = ("aware", "agnostic")


def answer(loaded, new_policy, ids: list[int], split: int, max_new_tokens: int, protocol: str = "aware",
           usage: Optional[Usage] = None, compile: bool = False) -> tuple[str, object]:
    """Greedy answer to the prompt ids, whose question starts at ids[split], under `protocol` -> (answer,
    the policy instance that answered).  aware: the whole prompt is compressed (`generate`); agnostic: the
    context ids[:split] is compressed alone (prefill_context) and the question ids[split:] appended
    to it (one decode step per token).  Both see the same tokens; the cost goes to `usage`."""
    if protocol == "aware":
        policy = new_policy()
        return generate(loaded, policy, ids, max_new_tokens, usage, compile), policy
    if not 0 < split < len(ids):
        raise ValueError(f"the question must start inside the prompt: split {split} of {len(ids)} tokens")
    if compile:
        raise UsageError("--compile is not supported with --protocol agnostic")
    model, tokenizer = loaded.model, loaded.tokenizer
    room = len(ids) - split + max_new_tokens
    ctx = prefill_context(model, tokenizer, ids[:split], new_policy, room)
    result = engine.generate(model, tokenizer, [ids[split:]], max_new_tokens, context=ctx)
    if usage is not None:
        s = result.stats
        usage.add(model.cache, len(ids), s["decode_steps"], s["decode_seconds"],
                  s["prefill_seconds"] + ctx.prefill_seconds)
    return result.texts[0].strip(), model.cache


def forced_logits(model, tokens: torch.Tensor, context_length: int, policy=None, prefill=prefill_step,
                  decode=decode_step, usage: Optional[Usage] = None) -> torch.Tensor:
    """Logits [E, V] (float32) predicting tokens[C:] (tokens: LongTensor [W], C = context_length,
    E = W - C): prefill tokens[:C] with `policy` (`full` if None), then feed tokens[C:W-1]
    one decode step at a time, so decode-time eviction and merging act as during generation.
    No host sync inside the loop; its cost goes to `usage`."""
    W, C = tokens.shape[0], context_length
    if not 0 < C < W:
        raise ValueError(f"context_length {C} must lie in (0, {W})")
    device = model.output.weight.device
    tokens = tokens.to(device)
    pos = torch.arange(W, device=device)[None]
    model.setup_caches(1, W, policy if policy is not None else FullCache())  # one slot to spare: a full cache is a special shape when compiled
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = [run_prefill(model, tokens[None, :C], pos[:, :C], prefill)]
        t1 = time.perf_counter()
        for i in range(W - C - 1):
            logits.append(run_decode(model, tokens[None, C + i:C + i + 1], pos[:, C + i:C + i + 1], i, decode))
        out = torch.cat(logits).float()                                       # [E, V]
        t2 = time.perf_counter()
    if usage is not None:
        usage.add(model.cache, C, W - C - 1, t2 - t1, t1 - t0)
    return out
