"""Batch invariance on the default Q4_1 GGUF (issue 49): a request's greedy answer, and the logits of its last
prompt token, should not depend on how it was run.  A ~1.5k-token chat prompt (a document of
data/paul_graham_essays and a question, as scripts/loadtest.py's `docs` workload builds them) run
  (a) in one pass (engine.generate, prefill_chunk above its length),
  (b) in chunks of 256 through runtime.rows.RowBatch alone,
  (c) in a RowBatch whose other rows decode beside it (their prefill and decode steps between its chunks),
  (d) after a prefix hit (RowBatch with prefix_bytes: another question on the same document went first, so
      only the question is prefilled, from a chunk boundary of its own).
(b) and (c) give bitwise the same logits and tokens: the quantized layers' one arithmetic (kernels/qlinear.py;
row by row: tests/test_qlinear_int.py) leaves no dependence on the other rows.  (a), (b) and (d) still differ
through the prefill attention alone (its fp32 sums follow the chunk's shape): a strict xfail until it is
chunk-invariant, and a test that the rest of the forward is (attention in float64: bitwise equal).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine
from cache import make_policy
from runtime.prefix_cache import common_prefix
from runtime.rows import RowBatch
from runtime.steps import prefill_step, run_prefill
from scripts.loadtest import QUESTIONS, document
from tests.helpers import needs_cpp

NEW = 32
CHUNK = 256


@pytest.fixture(scope="module")
def q4(default_gguf):
    model, tok = engine.load_model(default_gguf)
    prompts = [engine.encode_prompts(tok, [f"{document(0, 1700)}\n\n{q}"], chat=True)[0] for q in QUESTIONS[:2]]
    return model, tok, prompts


def one_pass(model, tok, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(a): engine.generate with the prompt in one pass -> (the logits [V] of its last token, the head's first
    output, taken by a hook; its greedy tokens)."""
    heads = []
    hook = model.output.register_forward_hook(lambda mod, args, out: heads.append(out[0, -1].clone()))
    try:
        r = engine.generate(model, tok, [ids], max_new_tokens=NEW, prefill_chunk=len(ids))
    finally:
        hook.remove()
    return heads[0], r.tokens[0]


def served(model, ids: list[int], others=(), first=None) -> tuple[torch.Tensor, list[int]]:
    """(b)-(d): `ids` through a RowBatch in chunks of CHUNK -> (logits [V] of its last prompt token, its NEW
    greedy tokens).  `others` are admitted first and decode beside it (each restarted when done, so they
    run the whole time); `first` (with prefix reuse) is served alone before it."""
    batch = RowBatch(model, lambda: make_policy("full"), 1 + len(others), len(ids) + 2 * NEW, NEW,
                     prefill_chunk=CHUNK, prefix_bytes=(1 << 30) if first else 0)
    with torch.inference_mode():
        if first:                                       # it keeps the prefix the two prompts share
            batch.start(first, prefix_len=common_prefix(first, ids))
            while not (done := batch.advance()):
                pass
            batch.release(done[0][0])
        last = {}                                       # row -> (its prompt index, the last token)
        for n, o in enumerate(others):
            row, logits = batch.admit([o])[0]
            last[row] = (n, int(logits.argmax()))
        mine, prompt_logits, tokens = batch.start(ids), None, []
        for _ in range(4 * (len(ids) // CHUNK + NEW)):
            for row, logits in batch.advance():
                prompt_logits, mine_row = logits, row
                tokens.append(int(logits.argmax()))
            if len(tokens) == NEW:
                break
            feed = {r: t for r, (_, t) in last.items()}
            if prompt_logits is not None:
                feed[mine_row] = tokens[-1]
            if not feed:
                continue
            step = batch.step(feed)
            for r, (n, _) in list(last.items()):
                last[r] = (n, int(step[r].argmax()))
            if prompt_logits is not None:
                tokens.append(int(step[mine_row].argmax()))
    assert not batch.holds(mine) and len(tokens) == NEW, "the request did not finish"
    if first:
        assert batch.prefixes.stats()["hits"] == 1
    return prompt_logits, tokens


@pytest.fixture(scope="module")
def runs(q4):
    """The request run the four ways: name -> (last prompt token's logits [V], greedy tokens)."""
    model, tok, (ids, other) = q4
    assert 1400 < len(ids) < 1700
    return {"one pass": one_pass(model, tok, ids), "chunks of 256": served(model, ids),
            "beside decoding rows": served(model, ids, others=[other[-300:], tok.encode("Hello there, how are")]),
            "after a prefix hit": served(model, ids, first=other)}


def same(runs, a: str, b: str) -> None:
    (la, ta), (lb, tb) = runs[a], runs[b]
    n = min(len(ta), len(tb))
    assert ta[:n] == tb[:n] and n >= 16, f"{a} vs {b}: {ta} vs {tb}"
    assert torch.equal(la, lb), f"{a} vs {b}: max |diff| {(la - lb).abs().max():.3g}"


@pytest.mark.model
@needs_cpp
def test_crowd_does_not_change_the_answer(runs):
    """(b) vs (c): other rows prefilling and decoding beside the request change none of its bits."""
    same(runs, "chunks of 256", "beside decoding rows")


@pytest.mark.model
@needs_cpp
@pytest.mark.xfail(strict=True, reason="the prefill attention (F.scaled_dot_product_attention over the cache, "
                   "model.grouped_attention) sums in an order that depends on the chunk's query and key counts; "
                   "test_only_attention_depends_on_the_chunks shows the rest of the forward does not")
@pytest.mark.parametrize("other", ["chunks of 256", "after a prefix hit"])
def test_one_pass_chunks_and_prefix_hit_agree(runs, other):
    """(a) vs (b), (a) vs (d): the same greedy tokens and bits (measured: max |logit diff| 0.72 and 0.76, the
    answers part at token 8: ' addiction and that' vs ' addiction, and that')."""
    same(runs, "one pass", other)


@pytest.mark.model
@needs_cpp
def test_only_attention_depends_on_the_chunks(q4, monkeypatch):
    """With the prefill attention in float64 (rounded back to fp32: no order dependence left in it) a 450-token
    prompt's last-token logits are bitwise equal in one pass and in chunks of 128: the quantized layers, the
    tied head, the embedding, norms and RoPE do not depend on the chunking (with fp32 attention: 0.79 apart)."""
    model, _, (ids, _) = q4
    ids = torch.tensor([ids[:450]])
    sdpa = F.scaled_dot_product_attention

    def sdpa64(q, k, v, attn_mask=None, **kw):
        mask = None if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.double()
        return sdpa(q.double(), k.double(), v.double(), attn_mask=attn_mask if mask is None else mask, **kw).float()
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa64)
    out = []
    for chunk in (450, 128):
        with torch.inference_mode():
            model.setup_caches(1, 460, make_policy("full"))
            out.append(run_prefill(model, ids, torch.arange(450)[None], prefill_step, chunk)[0])
    assert torch.equal(out[0], out[1]), (out[0] - out[1]).abs().max()
