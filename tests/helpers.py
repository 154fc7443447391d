"""Helpers shared by test modules."""
import shutil
import signal

import pytest
import torch

from checkpoint import build_model, read_hf_dir
from runtime.steps import _compiled, decode_step, run_decode, run_prefill


class Ids:
    """The smallest tokenizer engine.generate needs: prompts given as ids (EOS 127, pad 0)."""
    eos_ids, pad_id = [127], 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def fresh_compiles() -> dict:
    """Forget every compiled graph (dynamo's and runtime.steps.compiled_steps') -> dynamo's counters, cleared: a test
    then counts the graphs it compiles (counters["stats"]["unique_graphs"])."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    _compiled.clear()
    return counters


def tiny_hf_model(kind: str, tmp_path):
    """(transformers model, our model loaded from its saved directory) with random weights:
    'llama31' (llama3 rope scaling), 'mistral' (sliding window 8, head_dim 32), 'tied_gqa3'."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5)
    if kind == "llama31":
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    elif kind == "mistral":  # sliding window much shorter than the test sequence; head_dim != hidden/heads
        cfg = transformers.MistralConfig(**common, head_dim=32, sliding_window=8, rope_theta=10000.0)
    else:  # GQA 3:1, tied embeddings, like SmolLM2
        cfg = transformers.LlamaConfig(**{**common, "num_attention_heads": 6, "hidden_size": 96}, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms so a wrong norm layout cannot pass
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    args, tensors = read_hf_dir(tmp_path)
    return hf, build_model(args, tensors, "cpu", torch.float32)


def random_llama(args, seed: int = 0):
    """A model.Transformer of `args` with random weights (0.15 N(0, 1), norms near 1), in eval mode."""
    from model import Transformer
    torch.manual_seed(seed)
    m = Transformer(args).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.15 + (1.0 if p.dim() == 1 else 0.0))   # norms near 1
    return m


def kept(policy, layer=0):
    """Kept positions per (batch row, head) as sorted lists, empty slots dropped."""
    pos = policy.kept_positions(layer)
    return [[sorted(p for p in head.tolist() if p >= 0) for head in row] for row in pos]


def left_padded(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.zeros(len(lengths), T, dtype=torch.long)
    pos = torch.full((len(lengths), T), -1)
    for b, n in enumerate(lengths):
        tokens[b, T - n:] = torch.randint(0, vocab, (n,), generator=g)
        pos[b, T - n:] = torch.arange(n)
    return tokens, pos


def greedy_logits(model, policy, tokens, pos, steps=6, decode=None, max_seq=64, on_step=None):
    """Greedy decode under `policy` (None: the full cache) -> logits of each decode step [steps, B, V];
    on_step(i, cache, positions) after each step."""
    decode = decode or decode_step
    model.setup_caches(tokens.shape[0], max_seq, policy)
    out = []
    with torch.inference_mode():
        logits = run_prefill(model, tokens, pos)
        token, p = logits.argmax(-1, keepdim=True), pos[:, -1:] + 1
        for i in range(steps):
            logits = run_decode(model, token, p, i, decode)
            if on_step:
                on_step(i, model.cache, p)
            out.append(logits)
            token, p = logits.argmax(-1, keepdim=True), p + 1
    return torch.stack(out)


def compiled_and_eager_decode(model, ids, steps: int = 8):
    """(compiled, eager) logits [steps, B, V] of `steps` decode steps after prefilling ids [B, T]; asserts
    that the compiled step does not recompile after its third call."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    B, T = ids.shape
    step = torch.compile(decode_step, dynamic=True)
    with torch.inference_mode():
        model.setup_caches(B, T + steps + 8)
        model(ids, torch.arange(T))
        compiled, eager = [], []
        for s in range(steps):
            compiled.append(step(model, ids[:, s:s + 1], torch.full((B, 1), T + s), model.cache.n_filled))
            if s == 2:
                graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, "decode recompiled after warm-up"
        for s in range(steps):          # the same steps again: the cache's own count restarts at T
            eager.append(decode_step(model, ids[:, s:s + 1], torch.full((B, 1), T + s), T + s))
    return torch.stack(compiled), torch.stack(eager)


def prompt_logits(models, ids):
    """Logits [B, T, V] of each model for the prompt ids [B, T] (fresh caches)."""
    out = []
    with torch.inference_mode():
        for m in models:
            m.setup_caches(ids.shape[0], ids.shape[1])
            out.append(m(ids, torch.arange(ids.shape[1])))
    return out


# The C++ CPU kernels' tests run wherever a C++ compiler exists (make test's machines have one) and
# fail when the kernels do not build there: a build failure must never turn into skipped tests.
HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_cpp = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the CPU kernels cannot be built here")
if HAS_COMPILER:      # build (or load) them at collection, so tests may call torch.ops.kvc.* directly
    from kernels.cpu import cpu_kernels_available
    cpu_kernels_available()


def default_sigint() -> None:
    """preexec_fn for a child the test will Ctrl-C: SIGINT back to its default action.  A test run
    started in the background (`nohup make test &`) or a pytest-xdist worker ignores SIGINT, and an
    ignored signal stays ignored across exec, so the child would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
