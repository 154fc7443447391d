"""The contract's explicit state (cache/contract.py): the registry checks a class against the Protocol, the
storage flags read `storage_kind` (never the class), the model is told which forward is a decode step, and
the programs on the engine never write a policy's internals nor swap the model's cache behind its back."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cache import POLICIES, make_policy, register
from cache.contract import CachePolicy, contract_members
from cache.full import FullCache
from cache.kv_dtype import kv_storage
from cache.quantized import with_kv_bits
from model import DenseCache, ModelArgs, Transformer

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"dense", "dense_dtype", "kivi", "slots", "reader", "own"}


def test_register_refuses_a_class_without_a_contract_member():
    members = contract_members()
    assert {"storage_kind", "begin", "adopt", "n_filled", "full_cache_args"} <= set(members)

    class Bare:                                 # every member of FullCache but one
        pass
    for m in members:
        if m != "storage_kind":
            setattr(Bare, m, getattr(FullCache, m))
    Bare.name = "bare"
    with pytest.raises(TypeError, match="does not declare storage_kind"):
        register(Bare)
    assert "bare" not in POLICIES


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_declares_a_storage_kind(name):
    policy = make_policy(name)
    assert isinstance(policy, CachePolicy)
    assert policy.storage_kind in KINDS, policy.storage_kind


def test_the_storage_flags_follow_storage_kind():
    full = make_policy("full")
    assert full.storage_kind == "dense"
    assert kv_storage(make_policy("full"), 16, 0, 0, "bfloat16", torch.float32).storage_kind == "dense_dtype"
    assert with_kv_bits(make_policy("full"), 4, 32, 32).storage_kind == "kivi"
    assert with_kv_bits(make_policy("snapkv"), 4, 32, 32).storage_kind == "slots"
    with pytest.raises(ValueError, match="only `full`"):
        kv_storage(make_policy("snapkv"), 16, 0, 0, "bfloat16", torch.float32)
    with pytest.raises(ValueError, match="only `full`"):         # a reader over full is not full
        kv_storage(make_policy("hshare"), 16, 0, 0, "bfloat16", torch.float32)
    with pytest.raises(ValueError, match="no KIVI storage"):
        with_kv_bits(make_policy("pod"), 4, 32, 32)


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64))


def test_the_caller_says_which_forward_is_a_decode_step():
    """decode=True sends the step to the cache's decode hook (and only a one-token step); n_filled is the
    caller's count of what the cache held."""
    model = tiny()
    calls = []

    class Hooked(DenseCache):
        fused_dense_decode = False

        def decode(self, layer, q, k, v):
            calls.append(layer)
            return super().decode(layer, q, k, v)

    model.setup_caches(1, 16, Hooked())
    with torch.inference_mode():
        model(torch.randint(0, 64, (1, 4)), torch.arange(4))
        model(torch.randint(0, 64, (1, 1)), torch.tensor([4]))          # a one-token prompt chunk: prefill
        assert calls == [] and model.cache.n_filled == 5
        model(torch.randint(0, 64, (1, 1)), torch.tensor([5]), decode=True, n_filled=5)
        assert calls == [0, 1] and model.cache.n_filled == 6
        with pytest.raises(ValueError, match="one token"):
            model(torch.randint(0, 64, (1, 2)), torch.tensor([6, 7]), decode=True)


def test_use_cache_is_where_the_model_cache_changes():
    model = tiny()
    a = model.setup_caches(1, 8, FullCache())
    b = FullCache()
    b.setup(model.args, 1, 8, torch.float32, "cpu")
    model.use_cache(b)
    assert model.cache is b and a is not b


def assignments_into(tree: ast.AST):
    """(line, target text) of every assignment whose target is an attribute of something's `.cache`."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            text = ast.unparse(t)
            if isinstance(t, ast.Attribute) and (text.endswith(".cache") or ".cache." in text):
                yield node.lineno, text


def test_programs_on_the_engine_never_write_a_policy_or_swap_the_cache():
    """runtime/, engine.py and the server pass state to the model (forward's decode / n_filled, use_cache)
    instead of writing `model.cache = ...` or `model.cache.n_filled = ...`."""
    files = [ROOT / "engine.py", ROOT / "serve.py", *(ROOT / "runtime").glob("*.py"), *(ROOT / "server").glob("*.py")]
    found = [f"{f.relative_to(ROOT)}:{line}: {text}" for f in files if f.exists()
             for line, text in assignments_into(ast.parse(f.read_text()))]
    assert not found, found


def test_no_policy_probes_whether_it_is_set_up():
    """Attributes a policy sets up are declared (None until then), never probed with hasattr."""
    probes = [f"{f.relative_to(ROOT)}:{i}" for f in [ROOT / "model.py", *(ROOT / "cache").glob("*.py")]
              for i, line in enumerate(f.read_text().splitlines(), 1) if "hasattr(self" in line]
    assert not probes, probes
