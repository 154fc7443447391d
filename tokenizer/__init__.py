"""Text <-> token ids for the inference engine.

One `Tokenizer` class over three backends:

* byte-level BPE (HF ``tokenizer.json``, GGUF ``gpt2`` vocab, Llama 3 tiktoken ``tokenizer.model``),
  run by ``tiktoken`` with the pre-tokenizer expressed as a single regex;
* sentencepiece ``tokenizer.model`` (Llama 2 / Mistral).

Added/special tokens written in the text are matched before the backend runs (like HF's
default), BOS is added only when the checkpoint asks for it, and chat templates are rendered
with jinja2 the way ``transformers`` does.  ``transformers``/``tokenizers`` are not imported.

    tokenizer/core.py     `Tokenizer` (encode/decode, chat template, from_dir/from_gguf, write_hf_files),
                          `load_tokenizer`
    tokenizer/models.py   the backends (byte-level BPE on tiktoken, sentencepiece), pre-tokenizer regexes,
                          GPT-2's byte <-> unicode table
    tokenizer/files.py    reading HF tokenizer.json / tokenizer_config.json, tokenizer.model
                          (sentencepiece or tiktoken), chat templates
    tokenizer/stream.py   `TextStream`: decoded text handed out piece by piece as tokens arrive
"""
from __future__ import annotations

from tokenizer.core import Tokenizer, load_tokenizer
from tokenizer.models import BYTE_TO_UNICODE
from tokenizer.stream import TextStream, unfinished_tail

__all__ = ["BYTE_TO_UNICODE", "TextStream", "Tokenizer", "load_tokenizer", "unfinished_tail"]
