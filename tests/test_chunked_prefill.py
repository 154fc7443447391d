"""Compressing policies take their prompt in chunks (cache/staging.py, "staged" prefill) with the one-pass result:
the same kept positions, the same prompt logits and the same next decode step, on the policy matrix's tiny
random Llama; and RowBatch admits a compressing policy's prompt over several `advance` calls while
another row decodes, its greedy answer equal to engine.generate's alone (the tiny checkpoint; the default model
marked slow)."""
from __future__ import annotations

import pytest
import torch

import engine
from cache import make_policy
from cache.quantized import with_kv_bits
from runtime.rows import RowBatch
from runtime.steps import chunk_end, run_decode, run_prefill
from tests.helpers import left_padded
from tests.test_policy_matrix import ARGS, KIVI_G, KIVI_R, model  # noqa: F401  (model: the tiny Llama fixture)

T = 600                 # longer than every default budget: each policy compresses
SPECS = ["snapkv", "snapkv:head_agg=query", "pyramidkv", "tova", "h2o", "h2o:head_agg=max", "d2o", "knorm",
         "streaming", "simlayerkv", "knorm+hshare", "simlayerkv:strategy=prefill,n_recent=64,lazy_threshold=0.115", "snapkv+quest", "knorm+ds"]
# many small chunks; a boundary inside SnapKV's observation window (the last 32 queries: 590 of 600); the
# default's; 1 (chunks of 2, chunk_end)
CHUNKS = [7, 590, 256, 1]


def prefill(model, spec: str, tokens, pos, chunk: int, bits: int = 16):  # noqa: F811
    """Prefill tokens, pos [B, T] in chunks of `chunk` into a row instance of `spec` (decode_room set, as RowBatch
    makes them), then one greedy decode step -> (prompt logits [B, V], step logits [B, V], kept positions per
    layer sorted per head, the policy)."""
    policy = with_kv_bits(make_policy(spec), bits, KIVI_G, KIVI_R)
    policy.decode_room = 4
    model.setup_caches(tokens.shape[0], tokens.shape[1] + 4, policy)
    with torch.inference_mode():
        logits = run_prefill(model, tokens, pos, chunk=chunk)
        kept = [policy.kept_positions(layer).sort(-1).values for layer in range(ARGS.n_layers)]
        step = run_decode(model, logits.argmax(-1)[:, None], pos[:, -1:] + 1, 0)
    return logits, step, kept, policy, policy.describe()


def check_same(got, ref, what: str) -> None:
    assert got[4] == ref[4], f"{what}: the policy decided otherwise (describe)"
    for layer, (a, b) in enumerate(zip(got[2], ref[2])):
        assert torch.equal(a, b), f"{what}: layer {layer} keeps other positions than one pass"
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5, msg=f"{what}: prompt logits differ")
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5, msg=f"{what}: first decode step differs")


@pytest.mark.parametrize("spec", SPECS)
def test_chunked_prefill_keeps_what_one_pass_keeps(model, spec):  # noqa: F811
    g = torch.Generator().manual_seed(1)
    tokens, pos = torch.randint(0, ARGS.vocab_size, (1, T), generator=g), torch.arange(T)[None]
    ref = prefill(model, spec, tokens, pos, T)
    storage = ref[3].inner if ref[3].is_sparse_reader else ref[3]
    assert storage.staged is None and not storage.prefill_in_one_pass
    if spec != "simlayerkv":        # (its default strategy decides at decode step 1: prefill keeps every token)
        assert min(int((kept >= 0).sum(-1).max()) for kept in ref[2]) < T, "nothing compressed: nothing to compare"
    for chunk in CHUNKS:
        check_same(prefill(model, spec, tokens, pos, chunk), ref, f"{spec}, chunks of {chunk}")


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "pyramidkv", "d2o"])
def test_chunked_prefill_of_a_left_padded_batch(model, spec):  # noqa: F811
    """A left-padded batch (RowBatch's batch admission prefills one) chunked as in one pass."""
    tokens, pos = left_padded([600, 420, 530], vocab=ARGS.vocab_size)
    ref = prefill(model, spec, tokens, pos, 600)
    for chunk in (100, 595):
        check_same(prefill(model, spec, tokens, pos, chunk), ref, f"{spec}, chunks of {chunk}")


def test_chunked_prefill_with_kivi_storage(model):  # noqa: F811
    tokens, pos = torch.randint(0, ARGS.vocab_size, (1, T), generator=torch.Generator().manual_seed(2)), \
        torch.arange(T)[None]
    for spec in ("snapkv", "h2o"):
        check_same(prefill(model, spec, tokens, pos, 64, bits=4), prefill(model, spec, tokens, pos, T, bits=4), spec)


def test_staged_prompt_is_freed_and_one_pass_stays_for_generate(model):  # noqa: F811
    """The staging buffers live only while the prompt comes in; without decode_room (engine.generate) the
    policy takes its prompt in one pass and refuses a part of it."""
    tokens, pos = torch.randint(0, ARGS.vocab_size, (1, 100)), torch.arange(100)[None]
    policy = prefill(model, "snapkv:budget=40", tokens, pos, 30)[3]
    assert policy.staged is None and not policy.pending
    one_pass = make_policy("snapkv:budget=40")
    assert one_pass.prefill_in_one_pass
    model.setup_caches(1, 120, one_pass)
    one_pass.before_prefill(pos)
    with torch.inference_mode(), pytest.raises(ValueError, match="one pass"):
        model(tokens[:, :50], pos[:, :50])


def test_a_later_one_token_chunk_is_refused(model):  # noqa: F811
    """model.forward runs a one-token forward after the first as a decode step: a staged prompt refuses it
    (chunk_end never makes one)."""
    tokens, pos = torch.randint(0, ARGS.vocab_size, (1, 40)), torch.arange(40)[None]
    policy = make_policy("snapkv:budget=36")
    policy.decode_room = 4
    model.setup_caches(1, 44, policy)
    policy.before_prefill(pos)
    with torch.inference_mode():
        model(tokens[:, :39], pos[:, :39])
        with pytest.raises(ValueError, match="one token"):
            model(tokens[:, 39:], pos[:, 39:])
    assert [chunk_end(s, 41, 20) for s in (0, 20)] == [20, 41]
    assert [chunk_end(s, 5, 1) for s in (0, 2)] == [2, 5]


def serve_two(model, tok, spec: str, prompts: dict, new: int, chunk: int):
    """Greedy answers of prompts A and B through a RowBatch of `spec`: A is admitted and decodes; B starts and
    comes in one `advance` (a prefill chunk of `chunk` tokens) before each decode step of A.  Asserts both
    answers equal engine.generate's alone (one pass) -> the advances B took."""
    alone = {n: engine.generate(model, tok, [p], max_new_tokens=new, policy=make_policy(spec)).tokens[0]
             for n, p in prompts.items()}
    batch = RowBatch(model, lambda: make_policy(spec), 2, len(prompts["B"]) + new, new, prefill_chunk=chunk)
    got, rows, advances = {}, {}, 0
    with torch.inference_mode():
        (row, logits), = batch.admit([prompts["A"]])
        rows["A"], got["A"] = row, [int(logits.argmax())]
        pending = batch.start(prompts["B"])
        while rows:
            if batch.holds(pending):
                advances += 1
                for row, logits in batch.advance():
                    rows["B"], got["B"] = row, [int(logits.argmax())]
            logits = batch.step({r: got[n][-1] for n, r in rows.items()})
            for n, r in list(rows.items()):
                if len(got[n]) == new:
                    batch.release(r)
                    del rows[n]
                else:
                    got[n].append(int(logits[r].argmax()))
    for n in prompts:
        assert len(got[n]) == new
        assert got[n][:len(alone[n])] == alone[n], f"{n}'s served answer differs from generate's alone"
    return advances


@pytest.mark.parametrize("spec", ["snapkv:budget=64", "h2o:budget=64"])
def test_row_admission_interleaves_a_compressing_prompt_with_decode(tiny_dir, spec):
    """A's row decodes while B's long prompt comes in over several `advance` calls (a decode step of A between
    each two); both greedy answers equal engine.generate's alone."""
    model, tok = engine.load_model(tiny_dir)
    g = torch.Generator().manual_seed(3)
    prompts = {n: torch.randint(0, model.args.vocab_size, (k,), generator=g).tolist() for n, k in (("A", 50), ("B", 300))}
    assert serve_two(model, tok, spec, prompts, 8, 64) == 5, "B's 300 tokens come in chunks of 64"


@pytest.mark.slow
def test_row_admission_of_a_long_document_on_the_default_model(default_dir, essay_text):
    """The same with the real default model: a ~1.2k-token document under snapkv:budget=128, chunks of 256."""
    model, tok = engine.load_model(default_dir)
    prompts = {"A": tok.encode("Write a short poem about the sea."),
               "B": tok.encode(essay_text)[:1200] + tok.encode("\n\nSummarize the text above in one sentence.")}
    assert serve_two(model, tok, "snapkv:budget=128", prompts, 8, 256) == 5
