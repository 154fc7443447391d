"""model.py against HuggingFace transformers: tiny random Llama 3.1 / Mistral configs and the real
default model through both loading routes (GGUF file and converted HF directory)."""
import json

import pytest
import torch

import engine
from cache import make_policy
from cache.full import FullCache
import model as model_module
from model import ModelArgs
from runtime.steps import compiled_steps, run_prefill, warm_up
from tests.helpers import Ids, compiled_and_eager_decode, fresh_compiles, tiny_hf_model

transformers = pytest.importorskip("transformers")


# --------------------------------------------------------------------------- tiny random models

@pytest.mark.parametrize("kind", ["llama31", "mistral", "tied_gqa3"])
def test_tiny_prefill_chunks_and_decode_match_hf(kind, tmp_path):
    hf, ours = tiny_hf_model(kind, tmp_path)
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        ours.setup_caches(1, 64)
        got = [ours(ids[:, :13], torch.arange(13)), ours(ids[:, 13:24], torch.arange(13, 24))]
        got += [ours(ids[:, t:t + 1], torch.tensor([t]), decode=True) for t in range(24, 40)]
    got = torch.cat(got, dim=1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_tiny_llama31_args_parsed(tmp_path):
    hf, ours = tiny_hf_model("llama31", tmp_path)
    assert ours.args.rope_scaling["rope_type"] == "llama3"
    _, mistral = tiny_hf_model("mistral", tmp_path / "m")
    assert mistral.args.sliding_window == 8 and mistral.args.head_dim == 32


@pytest.mark.parametrize("kind", ["llama31", "mistral"])
def test_left_padded_batch_equals_single_sequences(kind, tmp_path):
    """Different prompt lengths in one batch: padding never attended, own positions per row."""
    _, ours = tiny_hf_model(kind, tmp_path)
    prompts = [torch.randint(0, 128, (n,)) for n in (5, 17, 11)]
    T, steps = 17, 6
    tokens = torch.zeros(3, T, dtype=torch.long)
    pos = torch.full((3, T), -1)
    for b, p in enumerate(prompts):
        tokens[b, T - len(p):], pos[b, T - len(p):] = p, torch.arange(len(p))
    follow = torch.randint(0, 128, (3, steps))
    with torch.no_grad():
        ours.setup_caches(3, 32)
        batch = [ours(tokens, pos)[:, -1:]]
        for s in range(steps):
            batch.append(ours(follow[:, s:s + 1], pos[:, -1:] + 1 + s, decode=True))
        batch = torch.cat(batch, dim=1)
        for b, p in enumerate(prompts):
            ours.setup_caches(1, 32)
            alone = [ours(p[None], torch.arange(len(p)))[:, -1:]]
            for s in range(steps):
                alone.append(ours(follow[b:b + 1, s:s + 1], torch.tensor([len(p) + s])))
            torch.testing.assert_close(batch[b], torch.cat(alone, dim=1)[0], atol=1e-5, rtol=1e-5)


def test_decode_attends_live_length_only(tmp_path, monkeypatch):
    """Decode cost follows the tokens in the cache, not max_seq_length."""
    _, ours = tiny_hf_model("llama31", tmp_path)
    seen = []
    real = model_module.grouped_attention
    monkeypatch.setattr(model_module, "grouped_attention", lambda q, k, v, m: seen.append(k.shape[2]) or real(q, k, v, m))
    with torch.no_grad():
        ours.setup_caches(1, 256)
        ours(torch.randint(0, 128, (1, 10)), torch.arange(10))
        ours(torch.randint(0, 128, (1, 1)), torch.tensor([10]), decode=True)
    assert set(seen[:2]) == {10} and set(seen[2:]) == {11}
    assert ours.cache.kv_bytes()["live"] * 256 == ours.cache.kv_bytes()["allocated"] * 11


def test_compiled_decode_matches_eager_without_recompiles(tmp_path):
    _, ours = tiny_hf_model("tied_gqa3", tmp_path)
    compiled, eager = compiled_and_eager_decode(ours, torch.randint(0, 128, (2, 12)))
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_modelargs_errors():
    with pytest.raises(ValueError, match="missing required field.*hidden_size"):
        ModelArgs.from_hf_config({"vocab_size": 10, "num_hidden_layers": 1, "num_attention_heads": 1,
                                  "intermediate_size": 4})
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelArgs.from_hf_config({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, "hidden_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 4})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        args = ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, intermediate_size=8,
                         rope_scaling={"rope_type": "yarn", "factor": 2.0})
        model_module.rope_inv_freq(args)


# --------------------------------------------------------------------------- the real default model

@pytest.fixture(scope="module")
def essay_ids(engine_gguf, essay_text):
    _, tok = engine_gguf
    return tok.encode(essay_text)[:512]


def last_logits(model, ids):
    with torch.inference_mode():
        model.setup_caches(1, len(ids))
        return model(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)[0, -1]


def test_real_model_gguf_logits_match_hf(engine_gguf, hf_gguf, essay_ids):
    ours = last_logits(engine_gguf[0], essay_ids)
    with torch.no_grad():
        ref = hf_gguf(torch.tensor([essay_ids])).logits[0, -1]
    assert (ours - ref).abs().max().item() < 1e-3


def test_real_model_dir_route_matches_hf_and_gguf(engine_dir, engine_gguf, default_dir, essay_ids):
    hf = transformers.LlamaForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()
    ours = last_logits(engine_dir[0], essay_ids)
    with torch.no_grad():
        ref = hf(torch.tensor([essay_ids])).logits[0, -1]
    assert (ours - ref).abs().max().item() < 1e-3
    # same weights bit for bit; logits agree up to BLAS summation order (mmap alignment differs)
    gguf_sd, dir_sd = engine_gguf[0].state_dict(), engine_dir[0].state_dict()
    assert all(torch.equal(gguf_sd[k], dir_sd[k]) for k in gguf_sd)
    torch.testing.assert_close(ours, last_logits(engine_gguf[0], essay_ids), atol=2e-5, rtol=0)
    config = json.loads((default_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True


def test_real_model_64_greedy_tokens_match_hf(engine_gguf, hf_gguf, essay_ids):
    model, tok = engine_gguf
    ours = engine.generate(model, tok, [essay_ids], max_new_tokens=64).tokens[0]
    with torch.no_grad():
        ref = hf_gguf.generate(torch.tensor([essay_ids]), max_new_tokens=64, do_sample=False,
                               eos_token_id=tok.eos_ids, pad_token_id=tok.eos_ids[0])[0, len(essay_ids):].tolist()
    ref = [t for t in ref if t not in tok.eos_ids]
    assert len(ours) == 64 and ours == ref


def test_real_model_chat_answers_paris_and_batch_equals_alone(engine_dir):
    model, tok = engine_dir
    prompts = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]
    batch = engine.generate(model, tok, prompts, max_new_tokens=24, chat=True)
    assert "Paris" in batch.texts[0]
    for p, text in zip(prompts, batch.texts):
        assert engine.generate(model, tok, [p], max_new_tokens=24, chat=True).texts[0] == text


def test_gguf_rope_freq_factors_equal_llama3_scaling():
    """Llama 3.1 GGUFs carry the scaling as per-frequency divisors (`rope_freqs.weight`)."""
    base = dict(vocab_size=8, dim=512, n_layers=1, n_heads=4, n_kv_heads=4, intermediate_size=8, rope_theta=500000.0)
    llama3 = ModelArgs(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    plain = model_module.rope_inv_freq(ModelArgs(**base))
    scaled = model_module.rope_inv_freq(llama3)
    assert not torch.allclose(plain, scaled)
    factors = ModelArgs(**base, rope_scaling={"rope_type": "freq_factors", "factors": (plain / scaled).tolist()})
    torch.testing.assert_close(model_module.rope_inv_freq(factors), scaled)


# h2o, d2o and full-kv4 are compiled against eager in test_policies.py (decode_step); compiling is
# most of this test's time, so the generate() path keeps one case per kind of cache change
@pytest.mark.parametrize("policy", ["full", "streaming", "snapkv", "snapkv-kv4"])
def test_generate_compiled_warms_up_and_never_recompiles(policy, tmp_path):
    """engine.generate(compile=True): compilation happens in the warm-up; a second request
    with another prompt length decodes with the same graphs and the same tokens as eager.  The
    prefill step is compiled too (compile_prefill) except for streaming, which checks the default."""
    _, ours = tiny_hf_model("tied_gqa3", tmp_path)
    counters = fresh_compiles()
    torch.manual_seed(1)
    # full: batch 1 (a [1, 1] token's stride is free to differ between warm-up and loop: it once recompiled)
    prompts = [torch.randint(0, 120, (n,)).tolist() for n in ((9,) if policy == "full" else (9, 14))]
    # streaming: budget 16 -> the second request's cache fills up and evicts mid-decode
    args = {"streaming": "budget=16,n_sink=2", "snapkv": "budget=12,obs_window=4", "h2o": "budget=12,n_sink=2",
            "d2o": "budget=12,n_sink=2"}
    make = (lambda: make_policy(policy, args[policy])) if policy in args else (lambda: None)
    if policy.endswith("-kv4"):      # KIVI storage (G 8, R 16: head_dim 16) under the same guarantees
        from cache.quantized import with_kv_bits
        name = policy[:-4]
        make = lambda: with_kv_bits(make_policy(name, args.get(name)), 4, 8, 16)  # noqa: E731
    both = policy != "streaming"
    first = engine.generate(ours, Ids(), prompts, max_new_tokens=6, compile=True, policy=make(), compile_prefill=both)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1 + both, "each compiled step should compile once, in the warm-up"
    second = engine.generate(ours, Ids(), [p + [5, 6, 7] for p in prompts], max_new_tokens=10, compile=True,
                             policy=make(), compile_prefill=both)
    assert counters["stats"]["unique_graphs"] == graphs, "a new request recompiled"
    eager = engine.generate(ours, Ids(), [p + [5, 6, 7] for p in prompts], max_new_tokens=10, policy=make())
    assert second.tokens == eager.tokens and len(first.tokens) == len(prompts)
    if policy == "full":   # a warm-up prompt sliced from the real one (as scripts/peers.py does) reuses the graphs
        prefill, decode = compiled_steps(torch.device("cpu"), prefill=True)
        ids = torch.tensor([prompts[0] * 2])
        warm_up(ours, prefill, decode, ids[:, :4])
        ours.setup_caches(1, ids.shape[1] + 4, FullCache())
        with torch.inference_mode():
            run_prefill(ours, ids, torch.arange(ids.shape[1])[None], prefill)
        assert counters["stats"]["unique_graphs"] == graphs, "a sliced warm-up prompt recompiled"
