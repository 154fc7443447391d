"""Reading a checkpoint's tokenizer files: HF tokenizer.json / tokenizer_config.json, tokenizer.model
(sentencepiece or tiktoken), chat templates (compiled the way transformers does)."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from pathlib import Path

import atomic_io
from tokenizer.models import (_BPE, _LLAMA3_PRE, GPT2_DIGITS_PATTERN, GPT2_PATTERN, LLAMA3_PATTERN,
                              LLAMA3_SPECIAL_TOKENS, NO_SPLIT_PATTERN, _from_byte_level, _SentencePiece,
                              _to_byte_level)

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
