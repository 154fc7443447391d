"""Tokenizer backends: encode(text without special tokens) -> ids, decode(ordinary ids) -> str.

Byte-level BPE run by tiktoken with the pre-tokenizer as one regex (the regexes and GPT-2's
byte <-> unicode table are here too), and sentencepiece.

Notes on exactness for byte-level BPE: tiktoken merges the adjacent pair whose concatenation has
the lowest rank, HF merges the listed pair with the lowest merge index.  With ranks = ids both
agree when merge results appear in id order (checked at load time; otherwise ranks are
re-derived from the merge order) and vocab tokens no merge produces are kept out of the
ranks.  They can still differ in the rare case where two tokens whose concatenation is a vocab
token are adjacent but that pair is not a listed merge.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import tiktoken

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes
# ---------------------------------------------------------------------------------------------

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# HF Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)] as ONE regex.  HF splits
# digits off first and runs the GPT-2 regex inside each piece, so a piece ends right before a
# digit: ` ?\p{N}+` becomes `\p{N}` and the whitespace lookahead `(?!\S)` must also accept a
# following digit ("abc  1" -> "abc", "  ", "1"; plain GPT-2 would give "abc", " ", " 1").
GPT2_DIGITS_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
)
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
NO_SPLIT_PATTERN = r"[\s\S]+"

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _split_pre_tokenizer(pattern: str) -> dict:
    """HF pre_tokenizer JSON: Split(pattern, Isolated) followed by ByteLevel without regex."""
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, {**_BYTE_LEVEL, "use_regex": False}]}


_GPT2_PRE = (GPT2_PATTERN, _BYTE_LEVEL)
_DIGITS_PRE = (
    GPT2_DIGITS_PATTERN,
    {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
)
_LLAMA3_PRE = (LLAMA3_PATTERN, _split_pre_tokenizer(LLAMA3_PATTERN))
_QWEN2_PRE = (QWEN2_PATTERN, _split_pre_tokenizer(QWEN2_PATTERN))
# GGUF tokenizer.ggml.pre -> (regex, HF pre_tokenizer JSON); names as in llama.cpp.
GGUF_PRE_TOKENIZERS = {
    "default": _GPT2_PRE, "gpt2": _GPT2_PRE, "gpt-2": _GPT2_PRE, "mpt": _GPT2_PRE, "olmo": _GPT2_PRE,
    "smollm": _DIGITS_PRE, "starcoder": _DIGITS_PRE, "refact": _DIGITS_PRE,
    "llama-bpe": _LLAMA3_PRE, "llama3": _LLAMA3_PRE, "dbrx": _LLAMA3_PRE, "smaug-bpe": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE, "deepseek-r1-qwen": _QWEN2_PRE,
}

# Llama 3.1+ special tokens (Meta's tokenizer.py), numbered after the base vocab.  Llama 3.0 named
# ids +4/+5/+8/+10 reserved_special_token_2..5 and numbers the later reserved tokens from 5.
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>",
] + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - 11)]

GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNKNOWN, GGUF_NORMAL = 3, 4, 2, 1


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _to_byte_level(b: bytes) -> str:
    return "".join(BYTE_TO_UNICODE[x] for x in b)


# byte-level char -> its byte; any other char below 256 -> U+FFFF, which latin-1 cannot encode
_FROM_BYTE_LEVEL = {**{i: 0xFFFF for i in range(256)}, **{ord(c): b for c, b in UNICODE_TO_BYTE.items()}}


def _from_byte_level(s: str) -> bytes:
    try:
        return s.translate(_FROM_BYTE_LEVEL).encode("latin-1")
    except UnicodeEncodeError:
        raise KeyError(s) from None  # s is not byte-level


# ---------------------------------------------------------------------------------------------
# Backends: encode(text without special tokens) -> ids, decode(ordinary ids) -> str
# ---------------------------------------------------------------------------------------------


class _BPE:
    """Byte-level BPE run by tiktoken (specials are handled by `Tokenizer`)."""

    def __init__(self, id_to_bytes: dict[int, bytes], merges, pattern: str, hf_pre_tokenizer: dict,
                 where: str, *, normalizer=None, add_prefix_space=False, ignore_merges=False):
        self.id_to_bytes = id_to_bytes
        self.pattern, self.hf_pre_tokenizer, self.ignore_merges = pattern, hf_pre_tokenizer, ignore_merges
        self.merges = merges  # [(a, b)] byte-level strings, or None (tiktoken file: every token mergeable)
        self.nfc, self.add_prefix_space = normalizer == "NFC", add_prefix_space
        self.hf_json = None  # original tokenizer.json, if loaded from one
        self.rank_to_id = None
        self.merges_consistent = True
        self.bytes_to_id: dict[bytes, int] = {}
        for i in sorted(id_to_bytes):
            self.bytes_to_id.setdefault(id_to_bytes[i], i)
        bytes_to_id = self.bytes_to_id
        ranks: dict[bytes, int] = {}
        if merges is None:
            ranks = dict(bytes_to_id)
        else:
            order: dict[bytes, int] = {}  # merge result -> first merge index
            last = -1
            for k, (a, b) in enumerate(merges):
                try:
                    r = _from_byte_level(a + b)
                except KeyError:
                    raise ValueError(f"{where}: merge {a!r} {b!r} is not byte-level encoded") from None
                if r not in bytes_to_id:
                    raise ValueError(f"{where}: merge {a!r} {b!r} produces a token that is not in the vocab")
                order.setdefault(r, k)
                self.merges_consistent &= bytes_to_id[r] >= last
                last = max(last, bytes_to_id[r])
            # Single bytes and merge results only: HF never produces other tokens from text.
            keep = {b: i for b, i in bytes_to_id.items() if len(b) == 1 or b in order}
            if self.merges_consistent:
                ranks = keep
            else:  # ids are not in merge order: rank by merge index and map ranks back to ids
                ranks = {b: order[b] if b in order else len(merges) + i for b, i in keep.items()}
                self.rank_to_id = {ranks[b]: i for b, i in keep.items()}
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        self.enc = tiktoken.Encoding(f"bpe:{where}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self._regex = None

    def encode(self, text: str) -> list[int]:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        if self.missing_bytes and _has_bytes(text, self.missing_bytes):
            ids = self._encode_dropping_missing_bytes(text)
        else:
            ids = self.enc.encode_ordinary(text)
        return [self.rank_to_id[r] for r in ids] if self.rank_to_id else ids

    def _encode_dropping_missing_bytes(self, text: str) -> list[int]:
        """Bytes without a vocab token are dropped inside each pre-token, as HF BPE does (unk=None)."""
        import regex  # tiktoken's own dependency

        self._regex = self._regex or regex.compile(self.pattern)
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        ids = []
        for m in self._regex.finditer(text):
            piece = m.group().encode("utf-8").translate(None, self.missing_bytes)
            if piece:
                ids += self.enc._encode_single_piece(piece)
        return ids

    def decode(self, ids) -> str:
        try:
            return b"".join(self.id_to_bytes[i] for i in ids).decode("utf-8", errors="replace")
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is not in the vocabulary") from None

    def token_to_id(self, text: str) -> int | None:
        return self.bytes_to_id.get(text.encode("utf-8"))


def _has_bytes(text: str, byte_set: bytes) -> bool:
    data = text.encode("utf-8", errors="surrogatepass")
    return len(data.translate(None, byte_set)) != len(data)


class _SentencePiece:
    """sentencepiece model (Llama 2 / Mistral ``tokenizer.model``)."""

    def __init__(self, sp, path: Path):
        self.sp, self.path = sp, path

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids))

    def token_to_id(self, text: str) -> int | None:
        i = self.sp.piece_to_id(text)
        return i if self.sp.id_to_piece(i) == text else None
