"""Streaming: the decoded text of a growing token sequence, handed out once it cannot change."""

from __future__ import annotations

from tokenizer.core import Tokenizer


def unfinished_tail(text: str) -> int:
    """Characters at the end of decoded text that the next token may still change: the replacement
    characters of a partial UTF-8 sequence."""
    return len(text) - len(text.rstrip("\ufffd"))


class TextStream:
    """The text of a growing token sequence, handed out piece by piece once it cannot change.

        stream = TextStream(tokenizer)
        for token in tokens: print(stream.push(token), end="", flush=True)
        print(stream.flush())                # the rest (a partial character at the very end included)
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, token: int) -> str:
        """Append one token id -> the new text that is final now (maybe "")."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        end = len(text) - unfinished_tail(text)
        new, self.sent = text[self.sent:end], max(self.sent, end)
        return new

    def flush(self) -> str:
        """The text not handed out yet."""
        text = self.tokenizer.decode(self.ids)
        rest, self.sent = text[self.sent:], len(text)
        return rest
