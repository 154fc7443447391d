"""Token-exact prompt assembly shared by the evals: a template around a long body, and
LongBench-style middle truncation.

Prompts are built as ids from separately tokenized pieces (template prefix + body + template
suffix), so a length or a budget is exact by construction; decoding and re-tokenizing a prompt
could merge a token or two at the seams.
"""
from __future__ import annotations

from runtime.context import SENTINEL, chat_pieces  # noqa: F401  (SENTINEL: the evals import it from here)


def wrap(tokenizer, content: str, chat: bool) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids) around the SENTINEL in `content`: the user message of the
    checkpoint's chat template with the generation prompt (chat, runtime.context.chat_pieces), or the plain
    text with the tokenizer's BOS, if it adds one (not chat)."""
    if content.count(SENTINEL) != 1:
        raise ValueError("the content must hold the sentinel exactly once")
    if chat:
        return chat_pieces(tokenizer, content)
    before, after = content.split(SENTINEL)
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
    return bos + tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)


def truncate_middle(ids: list, budget: int) -> list:
    """At most `budget` ids: when longer, the first ceil(budget/2) and the last floor(budget/2)
    (LongBench keeps the head and the tail; the middle of a long input matters least)."""
    if budget < 0:
        raise ValueError(f"budget {budget} < 0")
    if len(ids) <= budget:
        return list(ids)
    tail = budget // 2
    return list(ids[:budget - tail]) + (list(ids[-tail:]) if tail else [])
