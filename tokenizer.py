"""Text <-> token ids for the inference engine.

One `Tokenizer` class over three backends:

* byte-level BPE (HF ``tokenizer.json``, GGUF ``gpt2`` vocab, Llama 3 tiktoken ``tokenizer.model``),
  run by ``tiktoken`` with the pre-tokenizer expressed as a single regex;
* sentencepiece ``tokenizer.model`` (Llama 2 / Mistral).

Added/special tokens written in the text are matched before the backend runs (like HF's
default), BOS is added only when the checkpoint asks for it, and chat templates are rendered
with jinja2 the way ``transformers`` does.  ``transformers``/``tokenizers`` are not imported.

Notes on exactness for byte-level BPE: tiktoken merges the adjacent pair whose concatenation has
the lowest rank, HF merges the listed pair with the lowest merge index.  With ranks = ids both
agree when merge results appear in id order (checked at load time; otherwise ranks are
re-derived from the merge order) and vocab tokens no merge produces are kept out of the
ranks.  They can still differ in the rare case where two tokens whose concatenation is a vocab
token are adjacent but that pair is not a listed merge.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import unicodedata
from datetime import datetime
from pathlib import Path

import tiktoken

import atomic_io

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


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode text, special tokens, chat template.  Build with `from_dir`/`from_gguf`/`load_tokenizer`."""

    def __init__(self, backend, special_tokens: dict[str, int], *, skip_ids=(), bos_id=None, eos_ids=(),
                 pad_id=None, unk_id=None, add_bos=False, chat_template=None, vocab_size=None,
                 model_max_length=None, source=""):
        self.backend = backend
        self.special_tokens = {t: i for t, i in special_tokens.items() if t}  # text -> id, parsed in text
        self.special_ids = {i: t for t, i in self.special_tokens.items()}
        self.skip_ids = set(skip_ids)  # dropped by decode(skip_special_tokens=True)
        self.bos_id, self.pad_id, self.unk_id = bos_id, pad_id, unk_id
        self.eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.source = source
        self.vocab_size = vocab_size or max(self.special_ids, default=-1) + 1
        alts = sorted(self.special_tokens, key=len, reverse=True)  # longest match wins, like HF
        self._special_re = re.compile("(" + "|".join(map(re.escape, alts)) + ")") if alts else None
        self._compiled_template = None

    def __repr__(self):
        return (f"Tokenizer({self.source!r}, {type(self.backend).__name__}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_ids={self.eos_ids}, add_bos={self.add_bos})")

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids.  Special tokens in the text are always parsed; BOS only if the checkpoint adds it."""
        ids = [self.bos_id] if add_special_tokens and self.add_bos else []
        parts = self._special_re.split(text) if self._special_re else [text]
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self.special_tokens[part])
            elif part:
                ids += self.backend.encode(part)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Ids -> text; special tokens become their text unless `skip_special_tokens`."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        out, run = [], []
        for i in map(int, ids):
            if i in self.special_ids:
                out.append(self.backend.decode(run))
                run = []
                if not (skip_special_tokens and i in self.skip_ids):
                    out.append(self.special_ids[i])
            else:
                run.append(i)
        out.append(self.backend.decode(run))
        return "".join(out)

    def token_to_id(self, text: str) -> int | None:
        """Id of a single (special or ordinary) token given as text, or None."""
        return self.special_tokens[text] if text in self.special_tokens else self.backend.token_to_id(text)

    def id_to_text(self, i: int | None) -> str | None:
        return None if i is None else self.decode([i])

    # -- chat template -------------------------------------------------------------------------

    def check_chat_template(self) -> None:
        """ValueError unless the chat template (if any) is a string jinja compiles."""
        import jinja2

        if self.chat_template is None or self._compiled_template is not None:
            return
        if not isinstance(self.chat_template, str):
            raise ValueError(f"{self.source}: chat template is not a string ({type(self.chat_template).__name__})")
        try:
            self._compiled_template = _compile_chat_template(self.chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.source}: chat template does not compile ({type(e).__name__}: {e})") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the checkpoint's jinja chat template, as transformers does."""
        if not self.chat_template:
            raise ValueError(f"tokenizer from {self.source!r} has no chat template "
                             "(tokenizer_config.json 'chat_template' / GGUF 'tokenizer.chat_template')")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        names = {"bos_token": self.bos_id, "eos_token": self.eos_ids[0] if self.eos_ids else None,
                 "pad_token": self.pad_id, "unk_token": self.unk_id}
        special = {k: self.id_to_text(v) for k, v in names.items() if v is not None}
        kwargs = {"tools": None, "documents": None, **special, **kwargs}
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **kwargs)

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Load from an HF-style directory (tokenizer.json or tokenizer.model + *config.json)."""
        d = Path(path)
        if not d.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {d}")
        cfg = _read_json(d / "tokenizer_config.json", optional=True) or {}
        stm = _read_json(d / "special_tokens_map.json", optional=True) or {}
        gen = _read_json(d / "generation_config.json", optional=True) or {}
        tj_path, tm_path = d / "tokenizer.json", d / "tokenizer.model"
        tj = _read_json(tj_path) if tj_path.exists() else None
        added = {}  # id -> (content, special) from tokenizer_config.json
        for k, v in (cfg.get("added_tokens_decoder") or {}).items():
            added[int(k)] = (v["content"], v.get("special", True))
        defaults: dict = {}
        if tj is not None and not isinstance(tj, dict):
            raise ValueError(f"{tj_path}: tokenizer.json is not a JSON object")
        if tj is not None and _is_byte_level_bpe(tj):
            try:
                backend, tj_added, defaults = _bpe_from_tokenizer_json(tj, tj_path)
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{tj_path}: malformed tokenizer.json ({type(e).__name__}: {e})") from e
            added.update(tj_added)
            vocab_size = max([*backend.id_to_bytes, *added], default=-1) + 1
        elif tm_path.exists():
            backend, added_tm, defaults = _load_tokenizer_model(tm_path, has_config_specials=bool(added))
            added = {**added_tm, **added}
            n = backend.sp.get_piece_size() if isinstance(backend, _SentencePiece) else \
                max(backend.id_to_bytes) + 1
            vocab_size = max([n - 1, *added]) + 1
        elif tj is not None:
            m, pt = tj.get("model") or {}, tj.get("pre_tokenizer") or {}
            raise ValueError(f"{tj_path}: unsupported tokenizer.json (model {m.get('type')!r}, pre_tokenizer "
                             f"{pt.get('type')!r}); only byte-level BPE is supported - or provide tokenizer.model")
        else:
            raise FileNotFoundError(f"no tokenizer files in {d}: expected tokenizer.json (byte-level BPE) or "
                                    "tokenizer.model (sentencepiece or tiktoken)")
        specials = {c: i for i, (c, _) in added.items()}
        tok = cls(backend, specials, skip_ids=[i for i, (_, s) in added.items() if s], vocab_size=vocab_size,
                  source=str(d))

        def tid(name):  # config token (str or AddedToken dict) -> id
            v = cfg.get(name, stm.get(name))
            v = v.get("content") if isinstance(v, dict) else v
            return tok.token_to_id(v) if v else None

        def gen_ids(name):
            v = gen.get(name)
            return [] if v is None else v if isinstance(v, list) else [v]

        bos = tid("bos_token")
        tok.bos_id = bos if bos is not None else next(iter(gen_ids("bos_token_id")), defaults.get("bos"))
        eos = tid("eos_token")
        tok.eos_ids = list(dict.fromkeys([*([eos] if eos is not None else defaults.get("eos", [])),
                                          *gen_ids("eos_token_id")]))
        pad = tid("pad_token")
        tok.pad_id = pad if pad is not None else next(iter(gen_ids("pad_token_id")), defaults.get("pad"))
        unk = tid("unk_token")
        tok.unk_id = unk if unk is not None else defaults.get("unk")
        add_bos = cfg["add_bos_token"] if "add_bos_token" in cfg else defaults.get("add_bos", False)
        tok.add_bos = bool(add_bos and tok.bos_id is not None)
        tok.chat_template = _read_chat_template(d, cfg)
        mml = cfg.get("model_max_length")
        tok.model_max_length = int(mml) if isinstance(mml, (int, float)) and mml < 1e18 else None
        return tok

    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        """Load the vocab embedded in a GGUF file (``tokenizer.ggml.model == "gpt2"``)."""
        if isinstance(reader_or_path, (str, os.PathLike)):
            p = Path(reader_or_path)
            if not p.is_file():
                raise FileNotFoundError(f"GGUF file not found: {p}")
            import gguf

            try:
                reader = gguf.GGUFReader(p)
            except Exception as e:
                raise ValueError(f"{p}: cannot read GGUF file: {e}") from e
        else:
            reader = reader_or_path
            p = Path(getattr(reader.data, "filename", None) or "<GGUFReader>")
        return cls.from_gguf_metadata({name: f.contents() for name, f in reader.fields.items()}, p)

    @classmethod
    def from_gguf_metadata(cls, meta: dict, p: Path) -> "Tokenizer":
        """The vocab of a GGUF file from its metadata ({key: value}); `p` names the file in errors."""
        def field(name, default=None):
            return meta.get(name, default)

        model = field("tokenizer.ggml.model")
        if model is None:
            raise ValueError(f"{p}: GGUF file has no tokenizer (no 'tokenizer.ggml.model')")
        if model == "llama":
            raise ValueError(f"{p}: GGUF sentencepiece vocab (tokenizer.ggml.model='llama') is not supported; "
                             "load the tokenizer from the HF checkpoint directory (tokenizer.model) instead")
        if model != "gpt2":
            raise ValueError(f"{p}: unsupported GGUF tokenizer.ggml.model={model!r} (only 'gpt2' byte-level BPE)")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"{p}: unknown GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                             f"known: {sorted(GGUF_PRE_TOKENIZERS)}")
        pattern, hf_pre = GGUF_PRE_TOKENIZERS[pre]
        tokens, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{p}: GGUF gpt2 vocab needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
        types = field("tokenizer.ggml.token_type") or [GGUF_NORMAL] * len(tokens)
        id_to_bytes, specials, skip = {}, {}, []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNKNOWN):  # stored as raw text
                specials[t] = i
                if ty != GGUF_USER_DEFINED:
                    skip.append(i)
                continue
            try:
                id_to_bytes[i] = _from_byte_level(t)
            except KeyError:
                if ty == GGUF_NORMAL:
                    raise ValueError(f"{p}: token {i} {t!r} is not byte-level encoded") from None
                id_to_bytes[i] = t.encode("utf-8")  # UNUSED etc.
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        # llama.cpp looks whole pre-tokens up in the vocab first (HF ignore_merges) for Llama 3 only
        backend = _BPE(id_to_bytes, pairs, pattern, hf_pre, str(p), ignore_merges=pattern == LLAMA3_PATTERN)
        eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        arch = field("general.architecture")
        ctx = field(f"{arch}.context_length") if arch else None
        return cls(backend, specials, skip_ids=skip, bos_id=field("tokenizer.ggml.bos_token_id"), eos_ids=eos,
                   pad_id=field("tokenizer.ggml.padding_token_id"), unk_id=field("tokenizer.ggml.unknown_token_id"),
                   add_bos=field("tokenizer.ggml.add_bos_token", False), vocab_size=len(tokens),
                   chat_template=field("tokenizer.chat_template"), model_max_length=int(ctx) if ctx else None,
                   source=str(p))

    # -- export --------------------------------------------------------------------------------

    def write_hf_files(self, out_dir) -> list[Path]:
        """Write tokenizer.json (or copy tokenizer.model) + tokenizer_config.json loadable by HF and `from_dir`.

        Also adds ``eos_token_id`` (list) to generation_config.json when there are several EOS ids.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        text = self.id_to_text
        if isinstance(self.backend, _BPE):
            tj = self.backend.hf_json or self._build_tokenizer_json()
            if _bos_from_post_processor(tj.get("post_processor")) != (self.bos_id if self.add_bos else None):
                tj = {**tj, "post_processor": self._post_processor()}
            written.append(_write_json(out / "tokenizer.json", tj))
            tokenizer_class = "PreTrainedTokenizerFast"
        else:
            shutil.copyfile(self.backend.path, out / "tokenizer.model")
            written.append(out / "tokenizer.model")
            tokenizer_class = "LlamaTokenizer"
        cfg = {
            "tokenizer_class": tokenizer_class,
            "bos_token": text(self.bos_id), "eos_token": text(self.eos_ids[0]) if self.eos_ids else None,
            "pad_token": text(self.pad_id), "unk_token": text(self.unk_id),
            "add_bos_token": self.add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {str(i): {"content": t, "special": i in self.skip_ids}
                                     for i, t in sorted(self.special_ids.items())},
        }
        if self.model_max_length:
            cfg["model_max_length"] = self.model_max_length
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        written.append(_write_json(out / "tokenizer_config.json", cfg))
        if len(self.eos_ids) > 1:
            gpath = out / "generation_config.json"
            gen = _read_json(gpath, optional=True) or {}
            gen.setdefault("eos_token_id", self.eos_ids)
            if self.bos_id is not None:
                gen.setdefault("bos_token_id", self.bos_id)
            written.append(_write_json(gpath, gen))
        return written

    def _build_tokenizer_json(self) -> dict:
        b = self.backend
        vocab = {_to_byte_level(v): i for i, v in sorted(b.id_to_bytes.items())}
        for t, i in self.special_tokens.items():
            vocab.setdefault(t, i)
        merges = b.merges if b.merges is not None else _merges_from_ranks(b.id_to_bytes)
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": i in self.skip_ids}
                             for i, t in sorted(self.special_ids.items())],
            "normalizer": {"type": "NFC"} if b.nfc else None,
            "pre_tokenizer": b.hf_pre_tokenizer,
            "post_processor": self._post_processor(),
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": b.ignore_merges, "vocab": vocab, "merges": [list(m) for m in merges]},
        }


    def _post_processor(self) -> dict:
        """HF TemplateProcessing that adds BOS iff `add_bos`."""
        a, b = [{"Sequence": {"id": "A", "type_id": 0}}], [{"Sequence": {"id": "B", "type_id": 1}}]
        if not self.add_bos:
            return {"type": "TemplateProcessing", "single": a, "pair": a + b, "special_tokens": {}}
        t = self.id_to_text(self.bos_id)
        bos = [{"SpecialToken": {"id": t, "type_id": 0}}]
        return {"type": "TemplateProcessing", "single": bos + a, "pair": bos + a + bos + b,
                "special_tokens": {t: {"id": t, "ids": [self.bos_id], "tokens": [t]}}}


def load_tokenizer(path) -> Tokenizer:
    """Tokenizer from a checkpoint directory or a .gguf file (a directory holding only a .gguf works too)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return Tokenizer.from_gguf(p)
    if p.is_dir():
        if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return Tokenizer.from_gguf(ggufs[0])
        return Tokenizer.from_dir(p)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path not found: {p}")
    raise ValueError(f"{p}: expected a checkpoint directory or a .gguf file")


# ---------------------------------------------------------------------------------------------
# Loading helpers
# ---------------------------------------------------------------------------------------------


def _read_json(path: Path, optional: bool = False):
    if optional and not path.exists():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: cannot parse ({type(e).__name__}: {e})") from e


def _write_json(path: Path, obj) -> Path:
    return atomic_io.write_json(path, obj, ensure_ascii=False, indent=2)


def _read_chat_template(d: Path, cfg: dict) -> str | None:
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]
        named = {x.get("name"): x.get("template") for x in t}
        t = named.get("default", next(iter(named.values()), None))
    if not t and (d / "chat_template.jinja").exists():
        t = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if not t and (d / "chat_template.json").exists():
        t = (_read_json(d / "chat_template.json") or {}).get("chat_template")
    return t or None


def _pre_tokenizer_steps(tj: dict) -> list[dict]:
    pt = tj.get("pre_tokenizer") or {}
    return list(pt.get("pretokenizers", [])) if pt.get("type") == "Sequence" else [pt] if pt else []


def _is_byte_level_bpe(tj: dict) -> bool:
    model = tj.get("model") or {}
    byte_level = any(s.get("type") == "ByteLevel" for s in _pre_tokenizer_steps(tj))
    return model.get("type") == "BPE" and byte_level and not model.get("byte_fallback")


def _pattern_from_pre_tokenizer(tj: dict, where: Path) -> tuple[str, bool]:
    """tokenizer.json pre_tokenizer -> (single regex, add_prefix_space)."""
    pattern, digits, prefix = None, False, False
    for s in _pre_tokenizer_steps(tj):
        kind = s.get("type")
        if kind == "Split" and pattern is None and not digits:
            if s.get("behavior") != "Isolated" or s.get("invert"):
                raise ValueError(f"{where}: unsupported Split pre-tokenizer (behavior {s.get('behavior')!r}, "
                                 f"invert {s.get('invert')!r}); only Isolated is supported")
            pattern = (s.get("pattern") or {}).get("Regex")
            if pattern is None:
                raise ValueError(f"{where}: Split pre-tokenizer without a Regex pattern is not supported")
        elif kind == "Digits" and pattern is None and s.get("individual_digits"):
            digits = True
        elif kind == "ByteLevel":
            prefix = bool(s.get("add_prefix_space", False))
            if s.get("use_regex", True):
                if pattern is not None:
                    raise ValueError(f"{where}: Split followed by ByteLevel(use_regex=True) is not supported")
                pattern = GPT2_DIGITS_PATTERN if digits else GPT2_PATTERN
        else:
            steps = [x.get("type") for x in _pre_tokenizer_steps(tj)]
            raise ValueError(f"{where}: unsupported pre_tokenizer sequence {steps}")
    if digits and pattern != GPT2_DIGITS_PATTERN:
        raise ValueError(f"{where}: Digits is only supported before ByteLevel(use_regex=True)")
    return pattern or NO_SPLIT_PATTERN, prefix


def _bpe_from_tokenizer_json(tj: dict, path: Path):
    """HF byte-level BPE tokenizer.json -> (_BPE, {id: (content, special)}, defaults)."""
    model = tj["model"]
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError(f"{path}: BPE with continuing_subword_prefix/end_of_word_suffix is not supported")
    norm = tj.get("normalizer")
    norm_types = [n.get("type") for n in (norm.get("normalizers", []) if norm and norm.get("type") == "Sequence"
                                          else [norm] if norm else [])]
    if any(t != "NFC" for t in norm_types):
        raise ValueError(f"{path}: unsupported normalizer {norm_types} (only NFC)")
    pattern, prefix = _pattern_from_pre_tokenizer(tj, path)
    added = {a["id"]: (a["content"], bool(a.get("special"))) for a in tj.get("added_tokens") or []}
    id_to_bytes = {}
    for s, i in model["vocab"].items():
        if i in added:
            continue
        try:
            id_to_bytes[i] = _from_byte_level(s)
        except KeyError:
            raise ValueError(f"{path}: vocab token {i} {s!r} is not byte-level encoded") from None
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    backend = _BPE(id_to_bytes, merges, pattern, tj.get("pre_tokenizer"), str(path), normalizer="NFC"
                   if norm_types else None, add_prefix_space=prefix, ignore_merges=model.get("ignore_merges", False))
    backend.hf_json = tj
    defaults = {}
    bos = _bos_from_post_processor(tj.get("post_processor"))
    if bos is not None:
        defaults.update(bos=bos, add_bos=True)
    return backend, added, defaults


def _bos_from_post_processor(pp) -> int | None:
    """Id of the special token a TemplateProcessing puts first in single sequences (Llama 3 BOS), if any."""
    procs = (pp.get("processors") or []) if pp and pp.get("type") == "Sequence" else [pp] if pp else []
    for p in procs:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0]
            if "SpecialToken" in first:
                return p["special_tokens"][first["SpecialToken"]["id"]]["ids"][0]
    return None


def _load_tokenizer_model(path: Path, has_config_specials: bool):
    """tokenizer.model: sentencepiece protobuf, else tiktoken text ("base64token rank" lines)."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as sp_err:
        try:
            ranks = _read_tiktoken_file(path)
        except ValueError as tt_err:
            raise ValueError(f"{path}: neither a sentencepiece model ({sp_err}) nor a tiktoken BPE file "
                             f"({tt_err})") from None
        return _llama3_from_ranks(ranks, path, has_config_specials)
    added = {}
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            added[i] = (sp.id_to_piece(i), True)
    opt = lambda i: i if i >= 0 else None  # noqa: E731
    defaults = {"bos": opt(sp.bos_id()), "eos": [i for i in [opt(sp.eos_id())] if i is not None],
                "pad": opt(sp.pad_id()), "unk": opt(sp.unk_id()), "add_bos": True}
    return _SentencePiece(sp, path), added, defaults


def _read_tiktoken_file(path: Path) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except (ValueError, base64.binascii.Error):
                raise ValueError(f"line {n} is not 'base64token rank'") from None
    if not ranks:
        raise ValueError("empty file")
    return ranks


def _llama3_from_ranks(ranks: dict[bytes, int], path: Path, has_config_specials: bool):
    id_to_bytes = {i: b for b, i in ranks.items()}
    backend = _BPE(id_to_bytes, None, LLAMA3_PATTERN, _LLAMA3_PRE[1], str(path), ignore_merges=True)
    added = {}
    if not has_config_specials:  # Llama 3 defaults, numbered after the base vocab
        n = max(ranks.values()) + 1
        added = {n + k: (t, True) for k, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
    by_name = {t: i for i, (t, _) in added.items()}
    defaults = {"bos": by_name.get("<|begin_of_text|>"), "add_bos": True,
                "eos": [by_name[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>") if t in by_name]}
    return backend, added, defaults


def _merges_from_ranks(id_to_bytes: dict[int, bytes]) -> list[tuple[str, str]]:
    """HF merges equivalent to tiktoken ranks: every split of a token into two lower-ranked tokens."""
    ranks = {}
    for i in sorted(id_to_bytes):
        ranks.setdefault(id_to_bytes[i], i)
    merges = []
    for tok, r in sorted(ranks.items(), key=lambda x: x[1]):
        local = [(ranks[tok[:k]], ranks[tok[k:]], tok[:k], tok[k:]) for k in range(1, len(tok))
                 if tok[:k] in ranks and tok[k:] in ranks]
        merges += [(_to_byte_level(a), _to_byte_level(b)) for _, _, a, b in sorted(local)]
    return merges


def _compile_chat_template(template: str):
    """Jinja environment matching transformers' chat template rendering."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------

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
