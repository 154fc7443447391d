"""CUDA-only checks (marker `gpu`: skipped where torch sees no GPU, run wherever one is present).
On the CPU machines CI uses, the Triton kernels are checked against their twins under TRITON_INTERPRET=1
(tests/test_kernels.py, test_kivi_codec.py); here the same kernels run natively, and the engine's CUDA
paths (bfloat16 default, CUDA-graph compiled decode) are compared with eager."""
import pytest
import torch

import engine
from cache import make_policy
from kernels import approx_scores, sparse_decode_attention

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


@pytest.mark.parametrize("spec", ["full", "snapkv:budget=128", "hshare:preset=short"])
def test_compiled_cuda_graph_decode_equals_eager(default_dir, essay_text, spec):
    model, tokenizer = engine.load_model(default_dir, "cuda", "float32")
    prompt = essay_text[:2000]
    eager = engine.generate(model, tokenizer, [prompt], max_new_tokens=16, policy=make_policy(spec))
    compiled = engine.generate(model, tokenizer, [prompt], max_new_tokens=16, policy=make_policy(spec), compile=True)
    assert compiled.tokens == eager.tokens
