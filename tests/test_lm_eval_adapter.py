"""eval/lm_eval_adapter.py, the lm-evaluation-harness model `kvpolicy`: with the full cache its three request
types equal a direct HuggingFace transformers forward (loglikelihood, rolling perplexity) and engine.generate
(generate_until); a compressing policy changes them as its rule says; a local jsonl task runs end to end
through lm_eval.simple_evaluate and through the adapter's CLI, offline; bad model_args are one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lmeval extra (in the test extra): pip install -e '.[test]'")

import engine  # noqa: E402
from eval import lm_eval_adapter as adapter  # noqa: E402
from eval.common import UsageError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def requests(*args):
    """Harness Instances as the model reads them (only .args)."""
    return [SimpleNamespace(args=a) for a in args]


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return adapter.KVPolicyLM(checkpoint=str(tiny_dir), policy="full", max_length=24)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def hf_score(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The oracle: log-softmax of one transformers forward over context + continuation[:-1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([context + continuation[:-1]])).logits[0, len(context) - 1:].double()
    target = torch.tensor(continuation)
    return logits.log_softmax(-1).gather(-1, target[:, None]).sum().item(), bool((logits.argmax(-1) == target).all())


CONTEXT, CONTINUATION = "The quick brown fox jumps over the lazy", " dog and runs away"
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity.")


def test_full_loglikelihood_equals_a_direct_forward(lm, hf):
    (ll, greedy), (ll_empty, _) = lm.loglikelihood(requests((CONTEXT, CONTINUATION), ("", CONTINUATION)))
    ctx, cont = lm.tok_encode(CONTEXT), lm.tok_encode(CONTEXT + CONTINUATION)[len(lm.tok_encode(CONTEXT)):]
    want, want_greedy = hf_score(hf, ctx, cont)
    assert ll == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    cont = lm.tok_encode(CONTINUATION, add_special_tokens=False)      # empty context: the prefix token
    assert ll_empty == pytest.approx(hf_score(hf, [lm.prefix_token_id], cont)[0], abs=1e-4)
    # greedy: the continuation that is the model's own argmax
    greedy_cont = engine.generate(lm.model, lm.tokenizer, [ctx], 3).tokens[0]
    [(_, is_greedy)] = lm._loglikelihood_tokens([(None, ctx, greedy_cont)])
    assert is_greedy


def test_a_context_beyond_max_length_loses_its_left_end(lm, hf):
    ids = lm.tok_encode(TEXT)                          # > max_length 24 tokens
    assert len(ids) > lm.max_length + 1
    [(ll, _)] = lm._loglikelihood_tokens([(None, ids[:-5], ids[-5:])])
    assert ll == pytest.approx(hf_score(hf, ids[-(lm.max_length + 1):-5], ids[-5:])[0], abs=1e-4)


def test_full_rolling_equals_direct_perplexity(lm, hf, tiny_dir):
    ids = lm.tok_encode(TEXT, add_special_tokens=False)
    # one window (max_length above the text's length): every token given all before it and the prefix token
    wide = adapter.KVPolicyLM(checkpoint=str(tiny_dir), max_length=len(ids) + 1)
    assert wide.loglikelihood_rolling(requests((TEXT,))) == [pytest.approx(
        hf_score(hf, [lm.prefix_token_id], ids)[0], abs=1e-4)]
    # windows of 24 tokens: each token predicted once, each window from its own start
    want = hf_score(hf, [lm.prefix_token_id], ids[:24])[0]
    for start in range(24, len(ids), 24):
        end = min(start + 24, len(ids))
        want += hf_score(hf, ids[end - 25:start], ids[start:end])[0]
    [got] = lm.loglikelihood_rolling(requests((TEXT,)))
    assert got == pytest.approx(want, abs=1e-4)


def test_generate_until_equals_engine_generate_and_cuts_at_stop_strings(lm):
    ids = lm.tok_encode(CONTEXT)
    want = engine.generate(lm.model, lm.tokenizer, [ids], 12).texts[0]
    assert len(want) > 10
    stop = want[4:7]
    got = lm.generate_until(requests((CONTEXT, {"max_gen_toks": 12}), (CONTEXT, {"until": [stop], "max_gen_toks": 12}),
                                     (CONTEXT, {"until": ["never there", stop[1:]], "max_gen_toks": 12,
                                                "do_sample": False, "temperature": 0.0})))
    assert got == [want, want[:want.find(stop)], want[:want.find(stop[1:])]]
    assert adapter.cut_at_stop("a.b.c", [".", "b"]) == "a" and adapter.cut_at_stop("abc", []) == "abc"


def test_compressing_policies_change_the_scores_as_their_rule_says(tiny_dir, lm):
    ids = lm.tok_encode(TEXT)[:20]
    full = lm._loglikelihood_tokens([(None, ids[:14], ids[14:])])[0][0]
    snap = adapter.KVPolicyLM(checkpoint=str(tiny_dir), policy="snapkv:budget=6,obs_window=2", max_length=24)
    stream = adapter.KVPolicyLM(checkpoint=str(tiny_dir), policy='streaming:budget=8', max_length=24)
    kivi = adapter.KVPolicyLM(checkpoint=str(tiny_dir), kv_bits=4, kv_group_size=16, kv_residual=16, max_length=24)
    scores = [m._loglikelihood_tokens([(None, ids[:14], ids[14:])])[0][0] for m in (snap, stream, kivi)]
    assert all(torch.isfinite(torch.tensor(s)) and abs(s - full) > 1e-4 for s in scores), (full, scores)
    # rolling: windows start from one token, so a prompt-only compressor (snapkv) scores as the full cache,
    # a decode-time evictor (streaming) does not
    [roll_full], [roll_snap], [roll_stream] = (m.loglikelihood_rolling(requests((TEXT,))) for m in (lm, snap, stream))
    assert roll_snap == pytest.approx(roll_full, abs=1e-4) and abs(roll_stream - roll_full) > 1e-4


@pytest.mark.slow
def test_on_the_real_model_eviction_lowers_the_likelihood_of_an_essay(default_dir, essay_text):
    """The default model predicts an essay's next tokens worse from a compressed context than from the full one."""
    lms = {p: adapter.KVPolicyLM(checkpoint=str(default_dir), policy=p, max_length=256)
           for p in ("full", "snapkv:budget=32", "streaming:budget=32")}
    ids = lms["full"].tok_encode(essay_text)[:256]
    ll = {p: m._loglikelihood_tokens([(None, ids[:224], ids[224:])])[0][0] for p, m in lms.items()}
    assert ll["snapkv:budget=32"] < ll["full"] and ll["streaming:budget=32"] < ll["full"], ll
    text = lms["full"].tokenizer.decode(ids[:160])
    roll = {p: lms[p].loglikelihood_rolling(requests((text,)))[0] for p in ("full", "streaming:budget=32")}
    assert roll["streaming:budget=32"] < roll["full"], roll


# --------------------------------------------------------------------------- a local task, end to end

DOCS = [{"question": "Q: 2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 0, "text": TEXT},
        {"question": "Q: the sky is", "choices": [" blue", " green"], "answer": 1, "text": TEXT[:60]}]


def write_tasks(tmp: Path) -> Path:
    """A jsonl of DOCS and three task YAMLs over it (multiple choice, generation, rolling perplexity)."""
    data = tmp / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp / 'hf'}\n"
              f"test_split: test\n")
    (tmp / "mc.yaml").write_text(f"task: kv_mc\n{common}output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
                                 f"doc_to_choice: '{{{{choices}}}}'\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    (tmp / "gen.yaml").write_text(f"task: kv_gen\n{common}output_type: generate_until\ndoc_to_text: '{{{{question}}}}'\n"
                                  f"doc_to_target: '{{{{choices[answer]}}}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
                                  f"  max_gen_toks: 5\nmetric_list:\n  - metric: exact_match\n")
    (tmp / "ppl.yaml").write_text(f"task: kv_ppl\n{common}output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                                  f"doc_to_target: '{{{{text}}}}'\nmetric_list:\n  - metric: byte_perplexity\n")
    return tmp


def test_simple_evaluate_runs_a_local_task_offline(tiny_dir, tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    import lm_eval
    from lm_eval.tasks import TaskManager
    tasks = write_tasks(tmp_path)
    out = lm_eval.simple_evaluate(model="kvpolicy", tasks=["kv_mc", "kv_gen", "kv_ppl"],
                                  model_args=f'checkpoint={tiny_dir},policy="streaming:budget=16,n_sink=2"',
                                  task_manager=TaskManager(include_path=str(tasks)))
    res = out["results"]
    # the harness's numbers are the adapter's: accuracy from its loglikelihoods, the answers from its generations
    lm = adapter.KVPolicyLM(checkpoint=str(tiny_dir), policy="streaming:budget=16,n_sink=2")
    acc = [max(range(len(d["choices"])), key=lambda c: lm.loglikelihood(requests((d["question"], d["choices"][c])))[0][0])
           == d["answer"] for d in DOCS]
    assert res["kv_mc"]["acc,none"] == pytest.approx(sum(acc) / len(acc))
    gens = lm.generate_until(requests(*[(d["question"], {"until": ["\n"], "max_gen_toks": 5}) for d in DOCS]))
    assert res["kv_gen"]["exact_match,none"] == pytest.approx(
        sum(g.strip() == d["choices"][d["answer"]].strip() for g, d in zip(gens, DOCS)) / len(DOCS))
    nll = -sum(lm.loglikelihood_rolling(requests(*[(d["text"],) for d in DOCS])))
    n_bytes = sum(len(d["text"].encode()) for d in DOCS)
    assert res["kv_ppl"]["byte_perplexity,none"] == pytest.approx(float(torch.tensor(nll / n_bytes).exp()), rel=1e-6)


def run_cli(*argv):
    """The adapter's CLI in a subprocess, offline; its plumbing is under test, so the torch twins of the C++
    kernels run (KVC_CPU_KERNELS=0: no wait on a kernel build another process holds)."""
    return subprocess.run([sys.executable, "-m", "eval.lm_eval_adapter", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "KVC_CPU_KERNELS": "0"},
                          timeout=600)


def test_the_cli_runs_a_local_task_and_writes_results(tiny_dir, tmp_path):
    tasks = write_tasks(tmp_path)
    r = run_cli("--model_args", f'checkpoint={tiny_dir},policy="snapkv:budget=8,obs_window=4"', "--tasks", "kv_mc",
                "--include_path", str(tasks), "--output_path", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kv_mc" in r.stdout and "acc" in r.stdout
    [results] = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results.read_text())["results"]["kv_mc"]["acc,none"] in (0.0, 0.5, 1.0)


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, message", [
    ({"policy": "nosuch"}, "unknown policy 'nosuch'"),
    ({"policy": "snapkv:budget=64", "obs_window": 8}, 'must be quoted: policy="snapkv'),
    ({"policy": "snapkv:budget=4"}, "budget (4) must be at least the obs_window"),
    ({"chekpoint": "x"}, "unknown model_args key(s) chekpoint"),
    ({"kv_bits": "four"}, "kv_bits='four' is not an integer"),
    ({"batch_size": 4}, "batch_size must be 1"),
])
def test_bad_model_args_are_one_line_errors(args, message, tiny_dir):
    with pytest.raises(Exception) as e:
        adapter.KVPolicyLM(**{"checkpoint": str(tiny_dir), **args})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_harness_device_falls_back_like_its_hf_model():
    cuda = torch.cuda.is_available()
    assert adapter.harness_config({}, {"device": "cuda:0", "batch_size": 1, "max_batch_size": None}) == (
        {"device": "cuda:0", "batch_size": 1} if cuda else {"batch_size": 1})
    assert adapter.harness_config({"device": "cpu", "batch_size": 1}, {"device": "cuda:0", "batch_size": 1}) == {}
    assert adapter.harness_config({}, {"device": "cpu"}) == {"device": "cpu"}


def test_missing_checkpoint_and_bad_gen_kwargs(lm, tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        adapter.KVPolicyLM(checkpoint=str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="does not take gen_kwargs stop"):
        lm.generate_until(requests((CONTEXT, {"stop": ["x"]})))
    with pytest.raises(UsageError, match="needs model_args checkpoint"):
        adapter.parse_settings({"policy": "full"})


def test_the_cli_reports_bad_model_args_in_one_line(tmp_path):
    tasks = write_tasks(tmp_path)
    r = run_cli("--model_args", f"checkpoint={tmp_path / 'missing'}", "--tasks", "kv_mc", "--include_path", str(tasks))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: checkpoint"), r.stderr[-2000:]
