"""CUDA-only checks (marker `gpu`: skipped where torch sees no GPU, run wherever one is present).
On the CPU machines CI uses, the Triton kernels are checked against their twins under TRITON_INTERPRET=1
(tests/test_kernels.py, test_kivi_kernels.py, test_kivi_codec.py, test_qlinear.py); here the same cases run
natively, and the engine's CUDA paths (bfloat16 default, compiled decode) are compared with eager.  Results and
how they were run (the KVC_CPU_KERNELS=0 and checkpoint set-up of a GPU machine): docs/results.md section 14."""
import pytest
import torch

import engine
from cache import make_policy
from cache.kv_dtype import kv_storage
from kernels import approx_scores, sparse_decode_attention
from tests import test_kernels, test_kivi_int_triton, test_kivi_kernels, test_qlinear
from tests.helpers import random_llama

pytestmark = pytest.mark.gpu


def test_sparse_attention_triton_equals_twin_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, S, D, N = 2, 8, 2, 777, 64, 96
    q = torch.randn(B, Hq, 1, D, device="cuda", generator=g)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", generator=g) for _ in range(2))
    idx = torch.randint(0, S, (B, Hkv, N), device="cuda", generator=g)
    ref = sparse_decode_attention(q, k, v, idx, backend="torch")
    torch.testing.assert_close(sparse_decode_attention(q, k, v, idx, backend="triton"), ref, atol=1e-4, rtol=1e-4)


def test_label_scores_triton_equals_twin_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(1)
    q_label = torch.randn(2, 6, 8, device="cuda", generator=g)
    labels = torch.randn(2, 3, 301, 8, device="cuda", generator=g)
    ref = approx_scores(q_label, labels, backend="torch")
    torch.testing.assert_close(approx_scores(q_label, labels, backend="triton"), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", test_kernels._attn_cases(), ids=test_kernels._case_id)
def test_sparse_attention_interpreter_cases_on_cuda(case):
    ok, err = test_kernels._run_attn_case(case, "cuda")
    assert ok, err


@pytest.mark.parametrize("case", test_kernels._label_cases(), ids=test_kernels._case_id)
def test_label_scores_interpreter_cases_on_cuda(case):
    ok, err = test_kernels._run_label_case(case, "cuda")
    assert ok, err


def test_kivi_triton_equals_twin_on_cuda():
    assert test_kivi_kernels.triton_worst_error("cuda") <= 1e-4


def test_kivi_merge_equals_twin_on_cuda():
    assert test_kivi_kernels.merge_worst_error("cuda") <= 1e-5


def test_kivi_write_triton_equals_torch_bit_for_bit_on_cuda():
    assert test_kivi_kernels.triton_write_mismatches("cuda") == []


def test_kivi_decode_path_on_cuda(monkeypatch):
    """A tiny model's decode over KIVI storage through the CUDA path (one-launch write, Triton attention in
    fp32 arithmetic, merge) against the torch path (added after the last GPU session: not yet run on one)."""
    import kernels.kivi_int_triton as kit
    monkeypatch.setenv("KVC_KIVI_ARITH", "fp32")
    monkeypatch.setattr(kit, "_use_int", None)
    assert test_kivi_kernels.triton_decode_error("cuda") <= 1e-4


@pytest.mark.parametrize("case", [c for c in test_kivi_int_triton.CASES if c[0] != "switch"],
                         ids=test_kivi_int_triton.case_id)
def test_kivi_int_triton_equals_twin_on_cuda(case):
    """The integer KIVI kernel compiled for the GPU (int8 tl.dot) against its twin, the interpreter's cases."""
    run = {"twin": test_kivi_int_triton.twin_case, "residual": test_kivi_int_triton.residual_case}
    assert run[case[0]](*case[1:], device="cuda") <= test_kivi_int_triton.TOL


def test_qlinear_triton_gemv_equals_twin_on_cuda():
    results = test_qlinear.triton_cases("cuda")
    assert len(results) == 2 * len(test_qlinear.SCHEMES)
    for r in results:
        assert r["err"] <= 1e-5 * r["scale"] + 1e-6, r


@pytest.mark.parametrize("spec", ["full", "snapkv:budget=128", "hshare:preset=short"])
def test_compiled_decode_equals_eager_on_cuda(default_dir, essay_text, spec):
    model, tokenizer = engine.load_model(default_dir, "cuda", "float32")
    prompt = essay_text[:2000]
    eager = engine.generate(model, tokenizer, [prompt], max_new_tokens=16, policy=make_policy(spec))
    compiled = engine.generate(model, tokenizer, [prompt], max_new_tokens=16, policy=make_policy(spec), compile=True)
    assert compiled.tokens == eager.tokens


POLICIES = ["full", "streaming:budget=128", "h2o:budget=128", "snapkv:budget=128", "pyramidkv:budget=128",
            "d2o:budget=128", "simlayerkv:n_recent=128", "tova:budget=128", "ds:preset=short",
            "quest:preset=short", "hshare:preset=short", "pod"]


@pytest.mark.parametrize("kv_bits", [16, 4])
@pytest.mark.parametrize("spec", POLICIES)
def test_policies_answer_in_bfloat16_on_cuda(default_dir, spec, kv_bits):
    """Every policy in the CUDA default dtype (bfloat16), 16-bit and KIVI 4-bit KV, batch of two prompts
    left-padded: the chat answer names Paris (the prompts are shorter than the budgets: a check of the
    CUDA paths, not of eviction)."""
    model, tokenizer = engine.load_model(default_dir, "cuda")
    assert next(model.parameters()).dtype == torch.bfloat16
    try:
        policy = kv_storage(make_policy(spec), kv_bits, 32, 128, None, torch.bfloat16)
    except ValueError as e:       # a policy that refuses packed storage says so
        pytest.skip(str(e))
    prompts = ["What is the capital of France?", "Name the capital city of France, in one word."]
    r = engine.generate(model, tokenizer, prompts, max_new_tokens=16, chat=True, policy=policy)
    assert all("Paris" in t for t in r.texts), r.texts


def cuda_graph_count() -> int:
    """CUDA graphs cudagraph trees has recorded in this process (the benchmark's counter)."""
    from tests.test_benchmark import measure
    return measure.cuda_graphs_recorded(torch.device("cuda"))


GRAPH_SPECS = [("full", 16), ("full", 4), ("snapkv", 16), ("snapkv", 4), ("d2o", 16), ("pod", 16), ("ds", 16),
               ("quest", 16), ("hshare:ratios=1/2-1/2-1/2", 16)]


@pytest.mark.parametrize("spec,bits", GRAPH_SPECS, ids=[f"{s}-kv{b}" for s, b in GRAPH_SPECS])
def test_static_decode_replays_cuda_graphs(spec, bits):
    """Policies under compiled_steps on CUDA (GraphDecode, mode="reduce-overhead"): 200 steps over two left-padded
    rows give eager's logits, every step static, no graph skipped by Inductor (cudagraph_skips), and graphs are
    recorded per read bucket and step variant (HShare's select/reuse), not per step."""
    from torch._dynamo.utils import counters
    from runtime.steps import compiled_steps, decode_step, graph_report
    from tests import test_graph_ready as g
    model = random_llama(g.ARGS).cuda()
    eager = g.decode_run(model, g.policy_for(spec, bits), decode_step, g.STEPS)
    _, decode = compiled_steps(torch.device("cuda"))
    before, skips = cuda_graph_count(), counters["inductor"]["cudagraph_skips"]
    compiled = g.decode_run(model, g.policy_for(spec, bits), decode, g.STEPS)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    report = graph_report(decode)
    assert report["static_steps"] >= g.STEPS and report["dynamic_steps"] == 0
    assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor skipped CUDA graphs (see its warning)"
    # at most 4 buckets over 600..808 tokens, x 2 step variants (HShare), x 2 for a bucket clipped to the capacity
    assert 0 < cuda_graph_count() - before <= 16, "graphs recorded per step, not per bucket"


def test_rows_join_and_leave_between_replays_on_cuda():
    """RowBatch on CUDA over the compiled GraphDecode: rows admitted and released between replays give the
    eager logits, and no bucket needs more than its graph."""
    from runtime.steps import compiled_steps, graph_report
    from tests import test_rowbatch as r
    model = random_llama(r.ARGS).cuda()
    prompts = r.prompts_of({0: 90, 1: 40, 2: 130, 3: 70})
    arrivals = {0: 0, 1: 0, 2: 3, 3: 9}
    want, _ = r.drive(r.row_batch(model, "full", share_prefix=False), prompts, arrivals, staged=True)
    _, decode = compiled_steps(torch.device("cuda"))
    before = cuda_graph_count()
    got, _ = r.drive(r.row_batch(model, "full", share_prefix=False, decode=decode), prompts, arrivals, staged=True)
    for n in prompts:
        torch.testing.assert_close(got[n], want[n], atol=1e-4, rtol=1e-4)
    assert cuda_graph_count() - before <= 2 * graph_report(decode)["graphs"]
