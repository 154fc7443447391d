"""The `Tokenizer`: encode/decode with special tokens, chat template, loading (HF directory, GGUF) and
export to HF files; `load_tokenizer` picks the loader for a path."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from tokenizer.files import (_bos_from_post_processor, _bpe_from_tokenizer_json, _compile_chat_template,
                             _is_byte_level_bpe, _load_tokenizer_model, _merges_from_ranks, _read_chat_template,
                             _read_json, _write_json)
from tokenizer.models import (_BPE, GGUF_CONTROL, GGUF_NORMAL, GGUF_PRE_TOKENIZERS, GGUF_UNKNOWN,
                              GGUF_USER_DEFINED, LLAMA3_PATTERN, _from_byte_level, _SentencePiece, _to_byte_level)


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

    def encode(self, text: str, add_special_tokens: bool = True, plain=()) -> list[int]:
        """Text -> ids.  Special tokens in the text are parsed, but for those overlapping a `plain` span
        [(start, end) character offsets], encoded as the text they are; BOS only if the checkpoint adds it."""
        ids = [self.bos_id] if add_special_tokens and self.add_bos else []
        at = 0                                      # the text before `at` is encoded
        for m in self._special_re.finditer(text) if self._special_re else ():
            if any(start < m.end() and m.start() < end for start, end in plain):
                continue
            if m.start() > at:
                ids += self.backend.encode(text[at:m.start()])
            ids.append(self.special_tokens[m.group()])
            at = m.end()
        if at < len(text):
            ids += self.backend.encode(text[at:])
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

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """`messages` ({"role", "content": str}) rendered with the chat template -> ids, each message's content
        encoded as text: a special token written in it (say "<|im_end|>") is never that token's id, so a message
        cannot end its turn or open another.  ValueError when the template changes the text of a message that
        holds such a token (its span in the rendered text is then unknown)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        spans = self._content_spans(messages, text, add_generation_prompt)
        if spans is None:
            if self._special_re and any(self._special_re.search(m["content"]) for m in messages):
                raise ValueError("the chat template changes the messages' text, so the special-token text in a "
                                 "message cannot be kept as text")
            spans = []
        return self.encode(text, add_special_tokens=False, plain=spans)

    def _content_spans(self, messages: list[dict], text: str, add_generation_prompt: bool):
        """Where each message's content lies in `text` (the rendered messages) -> [(start, end)], found by
        rendering them with markers in place of the contents; None unless each marker is there once and putting
        the contents back gives `text` (the template left the contents as they are)."""
        tag = os.urandom(4).hex()
        marks = [f"\ue000{tag}:{i}\ue001" for i in range(len(messages))]
        skeleton = self.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                            add_generation_prompt)
        spans, out, at = [], [], 0
        for m, mark in zip(messages, marks):
            i = skeleton.find(mark, at)
            if i < 0 or skeleton.count(mark) != 1:
                return None
            out.append(skeleton[at:i])
            start = sum(map(len, out))
            out.append(m["content"])
            spans.append((start, start + len(m["content"])))
            at = i + len(mark)
        out.append(skeleton[at:])
        return spans if "".join(out) == text else None

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
