"""A context compressed once, questions appended to copies of its rows (prefill_context,
engine.generate(context=...), engine.py --context-file): the agnostic protocol's mechanics."""
import pytest
import torch

import engine
from cache import POLICIES, make_policy
from cache.full import FullCache
from cache.params import Budget
from runtime.context import append_tokens, encode_question, prefill_context, question_rows
from runtime.rows import RowBatch
from runtime.steps import UsageError, run_decode, run_prefill
from tests.helpers import kept

QUESTIONS = ["\n\nQuestion: What is this text about?", "\n\nQuestion: Who wrote it?",
             "\n\nWhat is the first word of the text?"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return engine.load_model(tiny_dir)


def spec(text):
    return lambda: make_policy(text)


def context_text(essay_text, n_chars=1500):
    return essay_text[:n_chars]


def one_prompt(model, tokenizer, ctx, question, new_tokens, policy=None):
    """The aware run of the same tokens: context + question prefilled as one prompt."""
    ids = ctx.ids + encode_question(tokenizer, question, ctx)
    return engine.generate(model, tokenizer, [ids], new_tokens, policy=policy)


def test_chat_split_falls_after_the_user_turns_text(tiny):
    """With a chat template the context opens the first user turn; the question and the template's end of
    turn + assistant header follow (SmolLM2's ChatML: the split is right after the context's last token)."""
    model, tok = tiny
    ctx = prefill_context(model, tok, "Some context.", None, room=32, chat=True)
    text = tok.decode(ctx.ids)
    assert text.endswith("<|im_start|>user\nSome context.") and text.startswith("<|im_start|>system\n")
    assert tok.decode(ctx.suffix) == "<|im_end|>\n<|im_start|>assistant\n"
    whole = tok.apply_chat_template([{"role": "user", "content": "Some context. Q?"}], add_generation_prompt=True)
    assert tok.decode(ctx.ids + encode_question(tok, " Q?", ctx)) == whole


def test_full_cache_answers_equal_one_prompt(engine_dir, essay_text):
    """The full cache: context compressed once + question appended == context and question as one prompt
    (tokens equal; the first answer token's logits within 1e-5 of their largest magnitude: the question goes
    through decode steps there, through one prefill here), and bit-equal to the question decoded after the context's own
    prefill (the row copy changes nothing)."""
    model, tok = engine_dir
    ctx = prefill_context(model, tok, context_text(essay_text), None, room=48, chat=True)
    for q in QUESTIONS[:2]:
        got = engine.generate(model, tok, [q], 16, context=ctx)
        want = one_prompt(model, tok, ctx, q, 16)
        assert got.tokens == want.tokens and got.texts[0].strip()
    ids = encode_question(tok, QUESTIONS[0], ctx)
    with torch.inference_mode():
        question_rows(model, ctx)
        logits = append_tokens(model, ids, len(ctx.ids))
        model.setup_caches(1, ctx.max_seq_length, FullCache())
        joined = torch.tensor([ctx.ids + ids])
        want = run_prefill(model, joined, torch.arange(joined.shape[1])[None])
        model.setup_caches(1, ctx.max_seq_length, FullCache())
        run_prefill(model, joined[:, :len(ctx.ids)], torch.arange(len(ctx.ids))[None])
        decoded = append_tokens(model, ids, len(ctx.ids))
    assert (logits - want).abs().max() <= 1e-5 * want.abs().max()      # measured: 3e-5 .. 5e-5 on logits up to ~20
    assert torch.equal(logits, decoded)


def test_snapkv_keeps_what_compressing_the_context_alone_keeps(tiny, essay_text):
    """The context's kept set is the one a prompt of the context alone keeps; the question's tokens are all
    kept after it (SnapKV's layers append decode tokens)."""
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text), spec("snapkv:budget=64"), room=40)
    n = len(ctx.ids)
    alone = make_policy("snapkv:budget=64")
    model.setup_caches(1, n + 1, alone)
    with torch.inference_mode():
        run_prefill(model, torch.tensor([ctx.ids]), torch.arange(n)[None])
    for layer in range(model.args.n_layers):
        assert kept(ctx.policy, layer) == kept(alone, layer)
        assert all(len(h) == 64 for h in kept(ctx.policy, layer)[0])
    q = encode_question(tok, QUESTIONS[0], ctx)
    engine.generate(model, tok, [QUESTIONS[0]], 4, context=ctx)
    for layer in range(model.args.n_layers):
        for head, context_head in zip(kept(model.cache, layer)[0], kept(alone, layer)[0]):
            assert set(range(n, n + len(q))) <= set(head)
            assert set(head) & set(range(n)) == set(context_head)
    assert kept(ctx.policy, 0) == kept(alone, 0)          # answering left the context's rows as they were


@pytest.mark.parametrize("policy", ["h2o:budget=48", "streaming:budget=48"])
def test_decode_time_eviction_goes_on_after_the_question(tiny, essay_text, policy):
    """An evicting policy holds its budget through the question and the answer: its newest tokens are kept."""
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text, 800), spec(policy), room=40)
    n, q = len(ctx.ids), encode_question(tok, QUESTIONS[0], ctx)
    result = engine.generate(model, tok, [QUESTIONS[0]], 8, context=ctx)
    last = n + result.stats["decode_steps"] - 1                   # the last token fed (question, then answer)
    assert last >= n + len(q)
    for layer in range(model.args.n_layers):
        for head in kept(model.cache, layer)[0]:
            assert len(head) == 48 and last in head and max(head) == last


# every registered policy whose layers evict at decode time (test_the_evicting_list_is_complete), a ratio and a
# reader over one; budget 48 of a ~200-token context, a 30-token question: longer than h2o's and d2o's recent
# windows, and knorm and tova protect no window at all
EVICTING = ["knorm:budget=48", "h2o:budget=48", "tova:budget=48", "streaming:budget=48", "d2o:budget=48",
            "knorm:ratio=0.7", "knorm+quest:budget=48,quest.n_sink=4,quest.n_recent=8,n_critical=24"]
LONG_QUESTION = "".join(QUESTIONS)


def kept_sets(model, rows=(0,)) -> list:
    """Per layer, per row in `rows`, per head: the set of positions model.cache holds."""
    return [[[set(h) for h in kept(model.cache, layer)[r]] for r in rows] for layer in range(model.args.n_layers)]


@pytest.mark.parametrize("policy", EVICTING)
def test_question_is_held_whole_until_the_answer_then_eviction_goes_on(tiny, essay_text, policy):
    """Agnostic protocol, an evicting policy: when the first answer token is sampled every question position is
    held in every layer and KV head (the context's tokens made room), at the context's kept count; answer tokens
    then evict as before (the count stays, the newest token is held, question tokens may leave)."""
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text, 800), spec(policy), room=64)
    n, q = len(ctx.ids), encode_question(tok, LONG_QUESTION, ctx)
    assert len(q) >= 28
    question_rows(model, ctx)
    context = kept_sets(model)                                      # a question's row before its question
    engine.generate(model, tok, [LONG_QUESTION], 1, context=ctx)     # ends as the first answer token is sampled
    question = set(range(n, n + len(q)))
    for layer, (start, before) in enumerate(zip(kept_sets(model), context)):
        for head, context_head in zip(start[0], before[0]):
            assert question <= head, (layer, sorted(question - head))
            assert len(head) == len(context_head) and head - question < context_head
    result = engine.generate(model, tok, [LONG_QUESTION], 16, context=ctx)
    last = n + result.stats["decode_steps"] - 1
    assert last > n + len(q) + 8
    for layer, (end, before) in enumerate(zip(kept_sets(model), context)):
        for head, context_head in zip(end[0], before[0]):
            assert len(head) == len(context_head) and last in head and max(head) == last


@pytest.mark.parametrize("policy", ["knorm", "h2o", "tova", "streaming"])
def test_decode_evict_false_compresses_at_prefill_only(tiny, essay_text, policy):
    """decode_evict=false (kvpress's rule): the context's kept set stays whole under the question and the answer,
    and every token they add is kept beside it, in every layer and KV head; the default evicts instead."""
    model, tok = tiny
    for evict in (False, True):
        ctx = prefill_context(model, tok, context_text(essay_text, 800),
                              spec(f"{policy}:budget=48,decode_evict={str(evict).lower()}"), room=64)
        question_rows(model, ctx)
        context = kept_sets(model)
        result = engine.generate(model, tok, [LONG_QUESTION], 16, context=ctx)
        added = set(range(len(ctx.ids), len(ctx.ids) + result.stats["decode_steps"]))
        assert len(added) > 40
        for layer, (end, before) in enumerate(zip(kept_sets(model), context)):
            for head, context_head in zip(end[0], before[0]):
                assert (head == context_head | added) != evict, (layer, evict)


def test_the_evicting_list_is_complete(tiny, essay_text):
    """Every registered storage policy (default arguments, budget 48 where it takes one) whose kept count stops
    growing while it decodes after a context evicts at decode time: it is in EVICTING, so the test above covers
    it.  simlayerkv is left out: its lazy layers are trimmed to the sinks and the last n_recent tokens (1024 by
    default) at the second decode step instead (the question's, under agnostic)."""
    model, tok = tiny
    names = {s.split(":")[0] for s in EVICTING}
    for name, cls in POLICIES.items():
        if cls.is_sparse_reader or name == "simlayerkv":
            continue
        text = f"{name}:budget=48" if issubclass(cls, Budget) else name
        ctx = prefill_context(model, tok, context_text(essay_text, 800), spec(text), room=8)
        engine.generate(model, tok, [[5, 6]], 1, context=ctx)
        before = [len(h) for layer in range(model.args.n_layers) for h in kept(model.cache, layer)[0]]
        engine.generate(model, tok, [[5, 6, 7, 8]], 1, context=ctx)
        after = [len(h) for layer in range(model.args.n_layers) for h in kept(model.cache, layer)[0]]
        assert name in names or all(b + 2 == a for b, a in zip(before, after)), name


def test_a_held_question_protects_its_own_row_only(tiny, essay_text):
    """Two rows copy one knorm context and append the same question; only row 0 holds it: row 1 keeps what a
    row appending it without a hold keeps (positions and logits), row 0 keeps the whole question."""
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text, 800), spec("knorm:budget=48"), room=64)
    n, q = len(ctx.ids), encode_question(tok, LONG_QUESTION, ctx)

    def append(rows, held):
        cache = question_rows(model, ctx, rows)
        if held:
            cache.hold_question(0, n, n + len(q))
        with torch.inference_mode():
            for i, t in enumerate(q):
                logits = run_decode(model, torch.tensor([[t]] * rows), torch.tensor([[n + i]] * rows), i)
        return kept_sets(model, range(rows)), logits

    rows, logits = append(2, True)
    alone, alone_logits = append(1, False)
    assert [layer[1] for layer in rows] == [layer[0] for layer in alone]
    torch.testing.assert_close(logits[1], alone_logits[0], atol=1e-5, rtol=1e-5)
    question = set(range(n, n + len(q)))
    assert all(question <= h for layer in rows for h in layer[0])
    assert not all(question <= h for layer in alone for h in layer[0])


@pytest.mark.parametrize("policy", ["knorm:budget=48", "h2o:budget=48", "knorm:ratio=0.7"])
def test_rowbatch_agnostic_rows_hold_what_generate_holds(tiny, essay_text, policy):
    """The server's path (RowBatch, agnostic=True): two requests share a compressed context and append their
    questions while a third, unrelated one (aware) decodes beside them.  When each question is in (its row in
    `joined`), the row holds the positions engine.generate(context=) holds as its first answer token is sampled;
    the third row holds what it holds alone."""
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text, 800), spec(policy), room=64)
    n = len(ctx.ids)
    questions = [encode_question(tok, x, ctx) for x in (LONG_QUESTION, QUESTIONS[1])]
    other = ctx.ids[::-1][:n - 20]

    def drive(requests, agnostic):
        batch = RowBatch(model, spec(policy), 3, n + 64, 64, prefix_bytes=1 << 30 if agnostic else 0,
                         min_prefix=16, agnostic=agnostic)
        pending = [batch.start(ids, prefix_len=n if ids is not other else None, new_tokens=8) for ids in requests]
        next_token, held = {}, {}
        while batch.pending:
            next_token.update({row: int(logits.argmax()) for row, logits in batch.advance()})
        assert [p.protocol for p in pending] == ["aware", "agnostic", "agnostic"][:len(requests)]
        for _ in range(max(map(len, questions)) + 2):
            logits = batch.step(next_token)
            next_token = {row: int(logits[row].argmax()) for row in next_token}
            for row in batch.joined:
                held[row] = [[set(h) for h in kept(batch.policy, layer)[row]] for layer in range(model.args.n_layers)]
                next_token[row] = int(logits[row].argmax())
        return held, [[set(h) for h in kept(batch.policy, layer)[0]] for layer in range(model.args.n_layers)]

    held, beside = drive([other, ctx.ids + questions[0], ctx.ids + questions[1]], True)
    assert sorted(held) == [1, 2]
    for row, q in zip((1, 2), questions):
        engine.generate(model, tok, [q], 1, context=ctx)
        assert held[row] == [layer[0] for layer in kept_sets(model)]
        assert all(set(range(n, n + len(q))) <= h for layer in held[row] for h in layer)
    assert beside == drive([other], False)[1]


def test_a_question_longer_than_the_row_can_hold_is_refused(tiny, essay_text):
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text, 800), spec("h2o:budget=16"), room=64)
    assert ctx.policy.question_room(0) == 12         # 16 less 4 sinks
    with pytest.raises(UsageError, match="a question of .* tokens cannot be held whole"):
        engine.generate(model, tok, [LONG_QUESTION], 4, context=ctx)
    assert prefill_context(model, tok, "ctx", spec("snapkv:budget=48"), room=8).policy.question_room(0) is None


@pytest.mark.parametrize("policy", ["snapkv:budget=48", "h2o:budget=48", "streaming:budget=48", "tova:budget=48",
                                    "pyramidkv:budget=48", "snapkv+quest:budget=128,n_critical=96"])
def test_questions_from_one_context_equal_separate_runs(tiny, essay_text, policy):
    """Several questions from one compressed context == each question with a context compressed for it alone
    (row copies through the contract's adopt; pyramidkv admits whole batches: its context is prefilled with
    each question)."""
    model, tok = tiny
    text = context_text(essay_text, 800)
    ctx = prefill_context(model, tok, text, spec(policy), room=40, chat=True)
    got = engine.generate(model, tok, QUESTIONS, 8, context=ctx)
    for i, q in enumerate(QUESTIONS):
        alone = prefill_context(model, tok, text, spec(policy), room=40, chat=True)
        assert engine.generate(model, tok, [q], 8, context=alone).tokens[0] == got.tokens[i]
    assert got.stats["context_prefills_again"] == (0 if ctx.copies_rows else len(QUESTIONS))


def test_full_cache_on_tiny_equals_one_prompt_for_several_questions(tiny, essay_text):
    model, tok = tiny
    ctx = prefill_context(model, tok, context_text(essay_text, 800), None, room=40)
    got = engine.generate(model, tok, QUESTIONS, 8, context=ctx)
    assert got.tokens == [one_prompt(model, tok, ctx, q, 8).tokens[0] for q in QUESTIONS]
    assert got.stats["context_tokens"] == len(ctx.ids) and got.stats["context_prefills_again"] == 0


@pytest.mark.parametrize("call, message", [
    (lambda m, t: prefill_context(m, t, "  \n", None), "empty context"),
    (lambda m, t: prefill_context(m, t, [], None), "empty context"),
    (lambda m, t: prefill_context(m, t, [5] * 8192, None), "longer than the model's context length 8192"),
    (lambda m, t: prefill_context(m, t, [5] * 8000, None, room=512), "exceeds the model's context length"),
    (lambda m, t: prefill_context(m, t, "x", None, room=0), "room"),
    (lambda m, t: engine.generate(m, t, [" "], 4, context=prefill_context(m, t, "ctx", None, room=8)),
     "empty question"),
    (lambda m, t: engine.generate(m, t, ["a long question " * 4], 4,
                                  context=prefill_context(m, t, "ctx", None, room=8)), "exceeds the context's room"),
    (lambda m, t: engine.generate(m, t, ["q"], 4, policy=make_policy("snapkv"),
                                  context=prefill_context(m, t, "ctx", None, room=8)), "are the context's"),
])
def test_bad_input_is_a_one_line_usage_error(tiny, call, message):
    model, tok = tiny
    with pytest.raises(UsageError, match=message) as e:
        call(model, tok)
    assert "\n" not in str(e.value)


def test_cli_context_file_answers_each_prompt(tiny_dir, tiny, essay_text, tmp_path, capsys):
    model, tok = tiny
    path = tmp_path / "context.txt"
    path.write_text(context_text(essay_text, 800))
    argv = ["--checkpoint", str(tiny_dir), "--context-file", str(path), "--chat", "--policy", "snapkv:budget=48",
            "--max-new-tokens", "6"] + [a for q in QUESTIONS[:2] for a in ("--prompt", q)]
    assert engine.main(argv) == 0
    out, err = capsys.readouterr()
    ctx = prefill_context(model, tok, path.read_text(), spec("snapkv:budget=48"), room=40, chat=True)
    want = engine.generate(model, tok, QUESTIONS[:2], 6, context=ctx).texts
    assert out == "".join(f"--- [{i}]\n{t}\n" for i, t in enumerate(want))
    assert "prefilled once" in err


@pytest.mark.parametrize("argv, message", [
    (["--context-file", "{empty}", "--prompt", "q"], "is empty"),
    (["--context-file", "{missing}", "--prompt", "q"], "cannot read --context-file"),
    (["--context-file", "{text}", "--prompt", "q", "--batch-size", "2"], "--batch-size does not apply"),
    (["--context-file", "{text}", "--prompt", "q", "--compile"], "--compile does not apply"),
])
def test_cli_context_bad_input(tiny_dir, tmp_path, capsys, argv, message):
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "text.txt").write_text("Some text.")
    paths = {"empty": tmp_path / "empty.txt", "missing": tmp_path / "nope.txt", "text": tmp_path / "text.txt"}
    argv = [a.format(**paths) for a in argv]
    assert engine.main(["--checkpoint", str(tiny_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
