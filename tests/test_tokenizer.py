"""Tests for tokenizer/ against HF transformers/tokenizers, tiktoken and sentencepiece oracles.

Note on the GGUF oracle: transformers' GGUF loader ignores `tokenizer.ggml.pre` and always uses a plain
ByteLevel pre-tokenizer, while SmolLM2's real tokenizer.json (and llama.cpp's "smollm" pre-tokenizer)
isolate digits first.  They differ on e.g. "abc  123" (" " + " 123" vs "  " + "123"), so the oracle
below is HF-from-GGUF with SmolLM2's original pre_tokenizer put back.
"""

import base64
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenizer import Tokenizer, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ESSAY_FILES = sorted((ROOT / "data" / "paul_graham_essays").glob("*.txt"))
ESSAYS = [Path(f).read_text(encoding="utf-8") for f in ESSAY_FILES]
needs_gguf = pytest.mark.usefixtures("default_gguf")    # fails (never skips) when the model is missing

# Meta's Llama 3 pre-tokenizer regex (llama3/tokenizer.py), written out here as an independent oracle.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

CODE = '''def fib(n):
    """Return the n-th Fibonacci number."""
\tif n < 2:  # tab-indented
\t\treturn n
    return fib(n - 1) + fib(n - 2)\r\n

class  Foo :\n    x = {"a": [1, 2, 3], 'b': None}  ;  y=x["a"][0]**2
'''
TEXTS = {
    "digits": "1234567 and 3.14159, 2024-11-22, 1,000,000 vs 1e-9 ٣٤ ½ ²",
    "digit_ws1": "abc  123",
    "digit_ws2": "x 1 2",
    "digit_ws3": "  42\n\n7",
    "digit_ws4": "a\t\t1 b \n 2\n  3   4    5 ",
    "code": CODE,
    "unicode": "Café naïve façade — “quotes” 日本語のテキスト 中文 한국어 Ελληνικά Привет! 🙂👍🏽🇫🇷 e\u0301",
    "whitespace": "   leading\n\n\n\nmany newlines\t\ttabs    spaces   \n \n trailing   ",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "specials_glued": "x<|im_end|><|im_end|>y <|endoftext|> <|im_start",
    "contractions": "I'm sure you'll see they've it's WE'RE don't",
    "empty": "",
    "single_space": " ",
}
for _k, _f in enumerate(ESSAYS[:4]):
    _paras = [p for p in _f.split("\n\n") if len(p) > 200]
    TEXTS[f"essay{_k}"] = "\n\n".join(_paras[:3])


def _ids(out):
    return out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out


# ---------------------------------------------------------------------------------------------
# GGUF SmolLM2
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_gguf):
    return Tokenizer.from_gguf(default_gguf)


@pytest.fixture(scope="module")
def hf_smol(default_gguf):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([  # SmolLM2's tokenizer.json pre_tokenizer
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return hf


@needs_gguf
def test_gguf_metadata(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1 and smol.eos_ids == [2] and smol.pad_id == 2 and smol.unk_id == 0
    assert smol.add_bos is False and smol.encode("hi")[0] != 1
    assert smol.special_tokens["<|im_start|>"] == 1 and len(smol.special_tokens) == 17
    assert smol.backend.merges_consistent  # GGUF merge results appear in increasing id order
    assert smol.chat_template and "im_start" in smol.chat_template
    assert smol.model_max_length == 8192


@needs_gguf
@pytest.mark.parametrize("name", list(TEXTS))
def test_gguf_matches_hf(smol, hf_smol, name):
    text = TEXTS[name]
    ours = smol.encode(text)
    assert ours == hf_smol.encode(text), name
    assert smol.encode(text, add_special_tokens=False) == ours  # add_bos_token is False
    assert smol.decode(ours) == text
    hf_text = hf_smol.decode(ours, clean_up_tokenization_spaces=False)
    assert smol.decode(ours) == hf_text
    assert smol.decode(ours, skip_special_tokens=True) == hf_smol.decode(
        ours, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@needs_gguf
def test_gguf_matches_hf_on_all_essays(smol, hf_smol):
    for path, text in zip(ESSAY_FILES, ESSAYS):
        ours = smol.encode(text)
        assert ours == hf_smol.encode(text), path
        assert smol.decode(ours) == text


@needs_gguf
def test_gguf_bytes_missing_from_vocab_are_dropped_like_hf(smol, hf_smol):
    # SmolLM2's vocab has no token for bytes like 0x04; HF drops them inside the pre-token
    missing = set(smol.backend.missing_bytes)
    assert 0x04 in missing and 0xF1 in missing
    for text in [".\x04.", "a\x04b", "x\U00040000y ok", "\x04"]:
        assert smol.encode(text) == hf_smol.encode(text), repr(text)


CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there\n  friend"},
     {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "Count: 1 2 3"}],
]


@needs_gguf
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_gguf_chat_template_matches_hf(smol, hf_smol, chat):
    msgs = CHATS[chat]
    for gen in (True, False):
        ours = smol.apply_chat_template(msgs, add_generation_prompt=gen)
        assert ours == hf_smol.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        hf_ids = _ids(hf_smol.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen))
        assert smol.encode(ours, add_special_tokens=False) == list(hf_ids)
    assert smol.apply_chat_template(msgs).endswith("<|im_start|>assistant\n")


TEMPLATE = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + m['role']) }}
    {% endif %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
  <{{ m['role'] }} n={{ ns.n }}>
    {{ m['content'] | tojson }}
    {% if loop.last %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{ bos_token }}assistant:{{ eos_token }}
{% endif %}"""


@needs_gguf
def test_custom_chat_template_matches_hf(smol, hf_smol):
    """Whitespace control (trim_blocks/lstrip_blocks), loop controls, namespace, tojson, raise_exception."""
    tok = Tokenizer(smol.backend, dict(smol.special_tokens), bos_id=1, eos_ids=[2], chat_template=TEMPLATE)
    for msgs in CHATS:
        for gen in (True, False):
            expect = hf_smol.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False,
                                                 add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == expect
    with pytest.raises(Exception, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@needs_gguf
def test_chat_template_missing_raises(smol):
    tok = Tokenizer(smol.backend, dict(smol.special_tokens), source="no-template")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])


@pytest.fixture(scope="module")
def written(smol, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol_hf")
    smol.write_hf_files(out)
    return out


@needs_gguf
def test_write_hf_files_roundtrip(smol, written):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(written)
    hf = AutoTokenizer.from_pretrained(str(written))
    assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.add_bos) == (smol.bos_id, smol.eos_ids, smol.pad_id, False)
    assert ours.chat_template == smol.chat_template and ours.vocab_size == smol.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    texts = list(TEXTS.values()) + ESSAYS
    for text in texts:
        ref = smol.encode(text)
        assert ours.encode(text) == ref, text[:60]
        assert list(hf.encode(text)) == ref, text[:60]
    for msgs in CHATS:
        assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            ours.apply_chat_template(msgs)


# ---------------------------------------------------------------------------------------------
# Trained byte-level BPE tokenizer.json files (tokenizers library as oracle), incl. the GGUF route
# ---------------------------------------------------------------------------------------------

PRE_KINDS = {  # kind -> GGUF tokenizer.ggml.pre name with the same pre-tokenization
    "gpt2": "gpt2", "digits": "smollm", "llama3": "llama-bpe", "qwen2": "qwen2"}


def _train_bpe(kind):
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = lambda p: pre_tokenizers.Sequence([  # noqa: E731
        pre_tokenizers.Split(Regex(p), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = {"gpt2": bl, "digits": pre_tokenizers.Sequence([pre_tokenizers.Digits(True), bl]),
                        "llama3": split(LLAMA3_REGEX), "qwen2": split(QWEN2_REGEX)}[kind]
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(ESSAYS + list(TEXTS.values()) * 3, trainer)
    return json.loads(tk.to_str())


def _write_gguf(path, tokens, types, merges, pre, model="gpt2"):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return {kind: _train_bpe(kind) for kind in PRE_KINDS}


def _check_against(ours, ref, texts, add_special_tokens=False):
    for text in texts:
        expect = ref.encode(text, add_special_tokens=add_special_tokens).ids
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expect, repr(text[:80])
        assert ours.decode(expect) == ref.decode(expect, skip_special_tokens=False)


@pytest.mark.parametrize("kind", list(PRE_KINDS))
def test_tokenizer_json_and_gguf_pre_tokenizers(trained, tmp_path, kind):
    from tokenizers import Tokenizer as HFTokenizer

    tj = trained[kind]
    ref = HFTokenizer.from_str(json.dumps(tj))
    texts = list(TEXTS.values()) + ESSAYS[:8]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.backend.merges_consistent and not ours.add_bos
    _check_against(ours, ref, texts)
    # the same vocab as a GGUF gpt2 vocab with the matching tokenizer.ggml.pre
    inv = {i: t for t, i in tj["model"]["vocab"].items()}
    special = {a["id"] for a in tj["added_tokens"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    _write_gguf(tmp_path / "t.gguf", [inv[i] for i in range(len(inv))],
                [3 if i in special else 1 for i in range(len(inv))], merges, PRE_KINDS[kind])
    g = load_tokenizer(tmp_path / "t.gguf")
    assert g.add_bos and g.bos_id == 1 and g.encode("hi")[0] == 1
    _check_against(g, ref, texts)


def test_tokenizer_json_ids_not_in_merge_order(trained, tmp_path):
    """Shuffled ids: merge order no longer matches ids, tiktoken ranks must be re-derived."""
    from tokenizers import Tokenizer as HFTokenizer

    tj = json.loads(json.dumps(trained["digits"]))
    vocab = tj["model"]["vocab"]
    special = {a["id"] for a in tj["added_tokens"]}
    ids = sorted(i for i in vocab.values() if i not in special)
    perm = dict(zip(ids, random.Random(0).sample(ids, len(ids))))
    tj["model"]["vocab"] = {t: perm.get(i, i) for t, i in vocab.items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    ours = Tokenizer.from_dir(tmp_path)
    assert not ours.backend.merges_consistent
    _check_against(ours, HFTokenizer.from_str(json.dumps(tj)), list(TEXTS.values()) + ESSAYS[:4])


def test_tokenizer_json_nfc_and_post_processor_bos(trained, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    tj = json.loads(json.dumps(trained["qwen2"]))
    tj["normalizer"] = {"type": "NFC"}
    tj["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    n = len(tj["model"]["vocab"])
    tj["added_tokens"] += [{"id": n + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": False} for k, c in enumerate(["<x>", "<x>y", "x>y"])]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.bos_id == 1 and ours.add_bos and ours.eos_ids == [2, 0]
    assert ours.encode("cafe\u0301") == ours.encode("café")
    texts = [TEXTS["unicode"], TEXTS["essay0"], "a<x>y<x>b <x>yx>y", "<<x>y>"]
    _check_against(ours, HFTokenizer.from_str(json.dumps(tj)), texts, True)
    assert ours.encode("a<x>yb", add_special_tokens=False)[1] == n + 1
    assert ours.encode("x", add_special_tokens=False)[0] != 1


# ---------------------------------------------------------------------------------------------
# Llama 3 style tiktoken tokenizer.model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm_vocab", "trained_vocab"])
def tiktoken_dir(request, tmp_path_factory):
    """A byte-level vocab written as a Llama-3-format tiktoken file ("base64 rank" lines, specials removed).

    smollm_vocab: SmolLM2's real vocab (lacks some single bytes, no multi-digit tokens);
    trained_vocab: a small BPE trained with the Llama 3 regex (has digit merges, so \\p{N}{1,3} matters).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if request.param == "smollm_vocab":
        hf = request.getfixturevalue("hf_smol")
        vocab, added = hf.get_vocab(), set(hf.added_tokens_decoder)
    else:
        tj = request.getfixturevalue("trained")["llama3"]
        vocab, added = tj["model"]["vocab"], {a["id"] for a in tj["added_tokens"]}
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(u2b[c] for c in t): i - len(added) for t, i in vocab.items() if i not in added}
    assert sorted(ranks.values()) == list(range(len(ranks)))
    d = tmp_path_factory.mktemp("llama3_tiktoken")
    with open(d / "tokenizer.model", "wb") as f:
        for b, r in sorted(ranks.items(), key=lambda x: x[1]):
            f.write(base64.b64encode(b) + b" " + str(r).encode() + b"\n")
    return d, ranks


def _llama3_reference(ranks):
    import tiktoken

    n = len(ranks)
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",  # Llama 3.1 list
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    names += [f"<|reserved_special_token_{2 + i}|>" for i in range(245)]
    specials = {t: n + k for k, t in enumerate(names)}
    return tiktoken.Encoding("llama3-ref", pat_str=LLAMA3_REGEX, mergeable_ranks=ranks,
                             special_tokens=specials), specials


LLAMA3_TEXTS = {
    "chat": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi 12345<|eot_id|>",
    "reserved": "a<|reserved_special_token_7|>b<|end_of_text|><|python_tag|><|eom_id|>",
    "numbers": "1234567 and 3.14159\n\n\n  x",
}


def test_tiktoken_model_file(tiktoken_dir):
    d, ranks = tiktoken_dir
    tok = Tokenizer.from_dir(d)
    ref, specials = _llama3_reference(ranks)
    n = len(ranks)
    assert tok.vocab_size == n + 256
    assert tok.bos_id == n == specials["<|begin_of_text|>"]
    assert tok.eos_ids == [n + 1, n + 8, n + 9] and tok.special_tokens["<|eot_id|>"] == n + 9
    assert tok.special_tokens["<|reserved_special_token_246|>"] == n + 255
    assert tok.add_bos
    texts = list(TEXTS.values()) + list(LLAMA3_TEXTS.values()) + ESSAYS[:8]
    for text in texts:
        expect = ref.encode(text, allowed_special="all")
        assert tok.encode(text) == [n] + expect, repr(text[:80])
        assert tok.encode(text, add_special_tokens=False) == expect
        assert tok.decode(expect) == text
    assert tok.decode(tok.encode(LLAMA3_TEXTS["chat"]), skip_special_tokens=True) == "user\n\nhi 12345"
    assert ref.decode(ref.encode(" 12345")[-1:]) in ("5", "45")  # digit groups of at most 3


def test_tiktoken_model_write_hf_files(tiktoken_dir, tmp_path):
    from transformers import AutoTokenizer

    d, ranks = tiktoken_dir
    tok = Tokenizer.from_dir(d)
    tok.write_hf_files(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (again.bos_id, again.eos_ids, again.add_bos) == (tok.bos_id, tok.eos_ids, True)
    for text in list(TEXTS.values()) + list(LLAMA3_TEXTS.values()) + ESSAYS[:4]:
        ref = tok.encode(text)
        assert again.encode(text) == ref, repr(text[:80])
        assert list(hf.encode(text)) == ref, repr(text[:80])


def test_tiktoken_model_with_config_specials(tiktoken_dir, tmp_path):
    d, ranks = tiktoken_dir
    n = len(ranks)
    (tmp_path / "tokenizer.model").write_bytes((d / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": False, "chat_template": "{{ bos_token }}"
        "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}",
        "added_tokens_decoder": {str(n): {"content": "<|bos|>", "special": True},
                                 str(n + 1): {"content": "<|eos|>", "special": True},
                                 str(n + 2): {"content": "<|tool|>", "special": False},
                                 str(n + 3): {"content": "<|tool|>call", "special": False}}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [n + 1, n + 2]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.vocab_size) == (n, [n + 1, n + 2], False, n + 4)
    ids = tok.encode("<|bos|>a<|tool|>")
    assert ids[0] == n and ids[-1] == n + 2
    assert tok.decode(ids, skip_special_tokens=True) == "a<|tool|>"  # non-special added token is kept
    assert tok.encode("<|tool|>call<|tool|>") == [n + 3, n + 2]  # longest added token wins, like HF
    assert tok.apply_chat_template([{"content": "é\"x"}]) == '<|bos|>"é\\"x"<|eos|>'


# ---------------------------------------------------------------------------------------------
# sentencepiece
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    (d / "train.txt").write_text("\n".join(ESSAYS[:12]), encoding="utf-8")
    spm.SentencePieceTrainer.train(  # Llama 2 style settings
        input=str(d / "train.txt"), model_prefix=str(d / "tokenizer"), vocab_size=500, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    (d / "train.txt").unlink()
    (d / "tokenizer.vocab").unlink()
    return d


def test_sentencepiece_model(sp_dir, tmp_path):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = Tokenizer.from_dir(sp_dir)
    assert (tok.bos_id, tok.eos_ids, tok.unk_id, tok.pad_id, tok.add_bos) == (1, [2], 0, None, True)
    assert tok.vocab_size == 500
    for text in list(TEXTS.values()) + ESSAYS[12:16]:
        assert tok.encode(text) == [1] + sp.encode(text), repr(text[:80])
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
        assert tok.decode(tok.encode(text)) == "<s>" + text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    ids = tok.encode("<s>Hi</s>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == sp.encode("Hi")
    # write_hf_files copies tokenizer.model; config keeps add_bos_token
    tok.write_hf_files(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    assert again.encode(TEXTS["code"]) == tok.encode(TEXTS["code"]) and again.add_bos


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_module_does_not_import_hf_libraries():
    import ast

    names = set()
    for path in sorted((ROOT / "tokenizer").glob("*.py")):
        tree = ast.parse(path.read_text())
        names |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"transformers", "tokenizers", "huggingface_hub"}, names


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*nope"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        Tokenizer.from_gguf(tmp_path / "x.gguf")


def test_dir_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files in .*expected tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="expected a checkpoint directory or a .gguf"):
        load_tokenizer(tmp_path / "config.json")


@pytest.mark.parametrize("content", ["not json at all", '{"model": {"type": "BPE", "vocab": {"a": 0'])
def test_garbage_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_unsupported_tokenizer_json(tmp_path):
    tj = {"model": {"type": "WordPiece", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "BertPreTokenizer"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match=r"tokenizer\.json.*WordPiece"):
        Tokenizer.from_dir(tmp_path)


def test_garbage_tokenizer_model(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01garbage\xff")
    with pytest.raises(ValueError, match=r"tokenizer\.model: neither a sentencepiece model .* nor a tiktoken BPE file"):
        Tokenizer.from_dir(tmp_path)


def test_garbage_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_tokenizer(tmp_path / "bad.gguf")


def test_gguf_unknown_pre_and_sentencepiece_vocab(tmp_path):
    toks = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    _write_gguf(tmp_path / "pre.gguf", toks, [3, 3] + [1] * 26, ["a b"], "my-new-pre")
    with pytest.raises(ValueError, match="'my-new-pre'"):
        load_tokenizer(tmp_path / "pre.gguf")
    _write_gguf(tmp_path / "spm.gguf", toks, [3, 3] + [1] * 26, None, None, model="llama")
    with pytest.raises(ValueError, match="sentencepiece.*HF checkpoint directory"):
        load_tokenizer(tmp_path / "spm.gguf")
