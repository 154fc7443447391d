"""Tensor parallelism (tp.py): two processes over gloo, spawned here, against one process.

A tiny random Llama (3 layers, 8 query heads, 4 KV heads, head_dim 16, an MLP width and vocabulary
that split in two) runs prefill + 8 teacher-forced decode steps for every registered policy (at
arguments that make it evict / select on 40-token prompts), batch 1 and batch 3 of different
lengths.  Both ranks must end every step with bit-identical logits, within 1e-5 of the single
process's (the row-parallel sums add in another order: up to 5e-6 here, on logits up to |4.7|, about
what perturbing the weights by 1e-7 relative does to the single process's own logits; with weights
of std 0.15 instead of 0.1 both reach 1-2e-5), holding exactly the single
process's kept positions for their own KV heads.  Exceptions, each for a documented reason: HShare's
head sharing (restricted to each process's heads: checked for that rule) and D2O over 4-bit KIVI
(KEPT_ONLY).  Weight-only int4/int8 checkpoints are sharded as stored (QARGS: an MLP width whose
halves hold whole scale groups).  The real default model runs the chat demo under torchrun --tp 3
(marked slow).  One spawn serves every case (the fixture `runs`), so the file stays near a minute.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from unittest import mock
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import engine
from runtime.steps import run_decode, run_prefill
import tp
from cache import POLICIES, make_policy
from cache.base import EvictionPolicy
from cache.calibration import ensure_channels, ensure_pod
from cache.quantized import with_kv_bits
from checkpoint import build_model
from model import ModelArgs
from kernels.qlinear import dequantize, resolve_qbackend
from quantize import quantize_state, quantize_weight
from tests.helpers import left_padded

ROOT = Path(__file__).resolve().parent.parent
ARGS = ModelArgs(vocab_size=256, dim=128, n_layers=3, n_heads=8, n_kv_heads=4, intermediate_size=100,
                 max_position_embeddings=512)
BATCHES = {"b1": [40], "b3": [40, 27, 33]}
STEPS = 8
READER = "n_critical=16,n_sink=2,n_recent=4"
# arguments under which a policy evicts or selects on these prompts, where its full_cache_args(16) (a budget of
# 16 of the 40 tokens) is not the configuration tested (a policy registered later runs at those)
POLICY_ARGS = {
    "streaming": "budget=16,n_sink=2", "h2o": "budget=16,n_sink=2",
    "snapkv": "budget=16,obs_window=4,kernel=3", "pyramidkv": "budget=16,obs_window=4,kernel=3",
    "d2o": "budget=16,n_sink=2,dense_share=0.34",
    "simlayerkv": "n_sink=2,n_recent=8,lazy_threshold=0.26",
    "ds": f"{READER},channels=prompt", "quest": f"{READER},page_size=4",
    "hshare": f"{READER},channels=prompt,head_ratio=1,layer_ratio=2/3,sim_queries=4",
    "pod": "n_sink=2,n_recent=8,blocks=prompt,cal_queries=8",
}
EXTRA = {   # label -> (spec, kv bits)
    "simlayerkv@prefill": ("simlayerkv:n_sink=2,n_recent=8,lazy_threshold=0.26,strategy=prefill,obs_window=4", 16),
    "pod@budget": ("pod:n_sink=2,n_recent=8,blocks=prompt,cal_queries=8,budget=24,obs_window=4,kernel=3", 16),
    "snapkv@query": ("snapkv:budget=16,obs_window=4,kernel=3,head_agg=query", 16),
    "snapkv+hshare": (f"snapkv+hshare:budget=24,obs_window=4,kernel=3,{READER},channels=prompt,head_ratio=1,"
                      f"layer_ratio=2/3,sim_queries=4", 16),
    "full@kv4": ("full", 4), "d2o@kv4": ("d2o:budget=16,n_sink=2,dense_share=0.34", 4),
    "hshare@heads": (f"hshare:{READER},channels=prompt,head_ratio=1/2,layer_ratio=2/3,sim_queries=4", 16),
    "quest@query": (f"quest:{READER},page_size=4,head_agg=query", 16),
    "ds@max": (f"ds:{READER},channels=prompt,head_agg=max", 16),
}
SHARING_ONLY = {"hshare@heads"}     # head sharing within each process: checked by its rule, not equality
# D2O over 4-bit KIVI re-rounds a packed group at every merge, so a one-ulp difference anywhere flips codes:
# in one process, weights perturbed by 1e-7 (relative) move its logits by 0.1 within 8 steps (the 16-bit
# cache: 7e-6).  Kept positions are still the single process's; logits are compared between ranks only.
KEPT_ONLY = {"d2o@kv4"}


def policy_args(name: str) -> str:
    """POLICY_ARGS[name], else the arguments under which the policy keeps 16 tokens (full_cache_args(16))."""
    if name in POLICY_ARGS:
        return POLICY_ARGS[name]
    return ",".join(f"{k}={v}" for k, v in (POLICIES[name].full_cache_args(16) or {}).items())


def cases() -> dict[str, tuple[str, int]]:
    named = {name: (f"{name}:{policy_args(name)}" if policy_args(name) else name, 16) for name in sorted(POLICIES)}
    return {**named, **EXTRA}


def hf_tensors(a: ModelArgs = ARGS) -> dict[str, torch.Tensor]:
    """Random HuggingFace-named weights of `a` (norms near 1)."""
    g = torch.Generator().manual_seed(0)
    D = a.head_dim

    def w(*shape, scale=0.1, base=0.0):
        return base + scale * torch.randn(*shape, generator=g)

    hf = {"model.embed_tokens.weight": w(a.vocab_size, a.dim), "model.norm.weight": w(a.dim, base=1.0),
          "lm_head.weight": w(a.vocab_size, a.dim)}
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        hf.update({p + "self_attn.q_proj.weight": w(a.n_heads * D, a.dim), p + "self_attn.o_proj.weight": w(a.dim, a.n_heads * D),
                   p + "self_attn.k_proj.weight": w(a.n_kv_heads * D, a.dim), p + "self_attn.v_proj.weight": w(a.n_kv_heads * D, a.dim),
                   p + "mlp.gate_proj.weight": w(a.intermediate_size, a.dim), p + "mlp.up_proj.weight": w(a.intermediate_size, a.dim),
                   p + "mlp.down_proj.weight": w(a.dim, a.intermediate_size),
                   p + "input_layernorm.weight": w(a.dim, base=1.0), p + "post_attention_layernorm.weight": w(a.dim, base=1.0)})
    return hf


# weight-only quantized checkpoints are sharded as stored: an MLP width whose halves hold whole groups of 32
QARGS = dataclasses.replace(ARGS, intermediate_size=128)
WEIGHT_MODES = {"int4": ("int4", 32), "int8": ("int8", 0)}      # int8: one scale per output row
QBACKENDS = ("torch", "cpp")


def quantized_tensors(mode: str) -> dict:
    kind, group = WEIGHT_MODES[mode]
    return quantize_state(hf_tensors(QARGS), QARGS, {"mode": kind, "group_size": group, "symmetric": False,
                                                    "head": "int8"})


def run_quantized(build) -> dict:
    """Each weight mode and quantized-linear backend: `build(args, tensors)` -> model, then full and
    snapkv at batch 3."""
    results = {}
    for backend in QBACKENDS:
        with mock.patch("kernels.qlinear.resolve_qbackend", lambda b, d, real=resolve_qbackend: real(backend, d)):
            for mode in WEIGHT_MODES:
                model = build(QARGS, quantized_tensors(mode))
                results.update({(f"{spec}@{mode}@{backend}", "b3"): run_case(model, spec, 16, BATCHES["b3"])
                                for spec in ("full", POLICY_SPEC_SNAPKV)})
    return results


POLICY_SPEC_SNAPKV = f"snapkv:{POLICY_ARGS['snapkv']}"
EVICTING = [name for name, cls in POLICIES.items() if issubclass(cls, EvictionPolicy)]


def run_case(model, spec: str, bits: int, lengths: list[int]) -> dict:
    """Prefill + STEPS decode steps fed fixed tokens -> logits [STEPS + 1, B, V], kept positions per
    layer, and the policy's description."""
    policy = with_kv_bits(make_policy(spec), bits, 8, 16)
    tokens, pos = left_padded(lengths, vocab=ARGS.vocab_size, seed=len(lengths))
    forced = torch.randint(0, ARGS.vocab_size, (len(lengths), STEPS), generator=torch.Generator().manual_seed(1))
    model.setup_caches(len(lengths), max(lengths) + STEPS + 1, policy)
    with torch.inference_mode():
        logits = [run_prefill(model, tokens, pos)]
        for i in range(STEPS):
            logits.append(run_decode(model, forced[:, i:i + 1], pos[:, -1:] + 1 + i, i))
        kept = [policy.kept_positions(layer).clone() for layer in range(ARGS.n_layers)]
    return {"logits": torch.stack(logits), "kept": kept, "describe": policy.describe()}


def run_all(model) -> dict:
    return {(label, b): run_case(model, spec, bits, lengths)
            for label, (spec, bits) in cases().items() for b, lengths in BATCHES.items()}


class CharTokenizer:
    """Token ids for the calibration text: one per character, within the tiny vocabulary."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % ARGS.vocab_size for c in text]


def calibrate(model, directory: Path) -> list[dict]:
    """The heavy-channel and POD files the policies' `prepare` makes beside a checkpoint in `directory`."""
    directory.mkdir(exist_ok=True)
    paths = ensure_channels(model, CharTokenizer(), directory), ensure_pod(model, CharTokenizer(), directory)
    return [json.loads(p.read_text()) for p in paths]


def file_cases(directory: Path) -> dict[str, tuple[str, int]]:
    """ds and pod reading the whole model's calibration files in `directory`."""
    return {"ds@file": (f"ds:{READER},channels={directory / 'heavy_channels.json'}", 16),
            "pod@file": (f"pod:n_sink=2,n_recent=8,blocks={directory / 'pod_calibration.json'}", 16)}


def run_with_files(model, directory: Path) -> dict:
    """Calibrate into `directory`, then run the cases that read calibration files from it."""
    results = {"calibration": calibrate(model, directory)}
    for label, (spec, bits) in file_cases(directory).items():
        results.update({(label, b): run_case(model, spec, bits, lengths) for b, lengths in BATCHES.items()})
    return results


def worker(rank: int, size: int, port: int, out: str) -> None:
    """One tensor-parallel process: environment as torchrun sets it, then the cases."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = tp.build(ARGS, hf_tensors(), torch.device("cpu"), torch.float32, size, head="vocab")
    results = {**run_all(model), **run_with_files(model, Path(out) / "calibrated")}
    results["rank_args"] = (model.args.n_heads, model.args.n_kv_heads, model.args.intermediate_size)
    replicated = tp.build(ARGS, hf_tensors(), torch.device("cpu"), torch.float32, size, head="replicated")
    results["replicated_head"] = run_case(replicated, "full", 16, BATCHES["b3"])
    results.update(run_quantized(lambda a, t: tp.build(a, t, torch.device("cpu"), torch.float32, size, head="vocab")))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    tp.finish()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process results, [rank 0's, rank 1's]) of every case."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tp")
    model = build_model(ARGS, hf_tensors(), "cpu", torch.float32)
    single = {**run_all(model), **run_with_files(model, out / "single"),
              **run_quantized(lambda a, t: build_model(a, t, "cpu", torch.float32))}
    mp.spawn(worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return single, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_each_process_holds_half_the_heads_and_mlp(runs):
    _, ranks = runs
    assert [r["rank_args"] for r in ranks] == [(4, 2, 50)] * 2


def test_calibration_files_are_the_single_process_ones(runs):
    """Missing calibration files are made by both processes (their heads' statistics all-gathered)."""
    single, ranks = runs
    (channels, pod) = single["calibration"]
    for r in ranks:
        got_channels, got_pod = r["calibration"]
        assert got_channels["n_kv_heads"] == got_pod["n_kv_heads"] == ARGS.n_kv_heads
        assert got_channels["channels"] == channels["channels"]
        torch.testing.assert_close(torch.tensor(got_channels["importance"]), torch.tensor(channels["importance"]),
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got_pod["similarity"]), torch.tensor(pod["similarity"]),
                                   rtol=0, atol=1e-5)


def test_a_replicated_output_head_gives_the_same_logits(runs):
    single, ranks = runs
    for r in ranks:
        torch.testing.assert_close(r["replicated_head"]["logits"], single[("full", "b3")]["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", EVICTING)
def test_every_eviction_policy_evicts_in_its_case(name):
    """Each registered eviction policy's case keeps fewer than the 40 + STEPS positions in some layer, so the
    TP comparison covers its eviction, not a cache that holds everything."""
    model = build_model(ARGS, hf_tensors(), "cpu", torch.float32)
    spec, bits = cases()[name]
    kept = run_case(model, spec, bits, BATCHES["b1"])["kept"]
    assert min(int((pos >= 0).sum(-1).min()) for pos in kept) < BATCHES["b1"][0] + STEPS, spec


@pytest.mark.parametrize("case", [(c, b) for c in [*cases(), *file_cases(Path())] for b in BATCHES],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_tp2_equals_one_process(runs, case):
    single, ranks = runs
    ref, r0, r1 = single[case], ranks[0][case], ranks[1][case]
    assert torch.equal(r0["logits"], r1["logits"]), "the processes must end every step with the same logits"
    if case[0] in SHARING_ONLY:
        return
    if case[0] not in KEPT_ONLY:
        torch.testing.assert_close(r0["logits"], ref["logits"], rtol=0, atol=1e-5)
    for layer in range(ARGS.n_layers):
        whole = ref["kept"][layer]
        if whole.shape[1] == 1:             # one position table shared by every head
            assert torch.equal(r0["kept"][layer], whole) and torch.equal(r1["kept"][layer], whole)
            continue
        half = whole.shape[1] // 2
        assert torch.equal(r0["kept"][layer], whole[:, :half]), f"layer {layer}, rank 0"
        assert torch.equal(r1["kept"][layer], whole[:, half:]), f"layer {layer}, rank 1"


@pytest.mark.parametrize("label,key", [("d2o", "layer_budgets"), ("simlayerkv", "lazy_layers"),
                                       ("simlayerkv@prefill", "lazy_layers"), ("hshare", "layer_roots"),
                                       ("hshare@heads", "layer_roots")])
def test_cross_head_decisions_are_the_single_process_ones(runs, label, key):
    """The decisions made global by a collective: D2O's layer budgets, SimLayerKV's lazy layers,
    HShare's layer sharing (also when its head sharing is restricted to each process)."""
    single, ranks = runs
    for b in BATCHES:
        want = single[(label, b)]["describe"][key]
        assert [r[(label, b)]["describe"][key] for r in ranks] == [want, want]


def test_hshare_head_sharing_stays_within_each_process(runs):
    single, ranks = runs
    for b in BATCHES:
        assert single[("hshare@heads", b)]["describe"]["selecting_heads_per_layer"] == 2      # of 4
        for r in ranks:
            d = r[("hshare@heads", b)]["describe"]
            assert d["selecting_heads_per_layer"] == 1                                        # of its 2
            assert d["head_roots"] == [[0, 0]] * ARGS.n_layers        # its second head shares its first's


# --------------------------------------------------------------------------- bad configurations

def clean_env(**extra) -> dict:
    """This environment without torchrun's variables (one thread per process), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


SAME = "the number of processes (--nproc-per-node x --nnodes) must equal --tp"


@pytest.mark.parametrize("argv,env,message", [
    (["--tp", "3"], {}, "--tp 3 needs 3 processes started by torchrun: torchrun --nproc-per-node 3 engine.py ... --tp 3"),
    (["--tp", "3"], {"WORLD_SIZE": "2", "RANK": "0"}, f"torchrun started 2 processes but --tp is 3: {SAME}"),
    ([], {"WORLD_SIZE": "2", "RANK": "0"}, f"torchrun started 2 processes but --tp is 1: {SAME}"),
    (["--tp", "0"], {}, "--tp must be at least 1, got 0"),
    (["--tp", "2"], {}, "--tp 2 does not divide the model's 3 KV heads (each process holds whole KV heads with their query heads): "
     "use --tp 3 or 1"),
])
def test_bad_launches_are_one_line_errors(default_dir, argv, env, message, monkeypatch, capsys):
    """In this process: every check runs before a process group is joined or a model is built."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert engine.main(["--checkpoint", str(default_dir), "--prompt", "hi", "--max-new-tokens", "2", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


HEADS_2 = ("error: --tp 2 does not divide the model's 3 KV heads (each process holds whole KV heads with their "
           "query heads): use --tp 3 or 1")


def test_the_benchmark_refuses_a_bad_tp_alike(default_dir, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchmark
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert benchmark.main(["--checkpoint", str(default_dir), "--tp", "2", "--policies", "full"]) == 2
    assert capsys.readouterr().err.strip() == HEADS_2


def test_under_torchrun_rank_0_says_why_before_torchrun_stops(default_dir):
    """torchrun stops every process once one exits non-zero: rank 0's line must be out by then."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "engine.py",
                        "--checkpoint", str(default_dir), "--prompt", "hi", "--tp", "2"],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert r.stderr.count(HEADS_2) == 1, r.stderr


@pytest.mark.parametrize("case", [(s, m, b) for b in QBACKENDS for m in WEIGHT_MODES for s in ("full", POLICY_SPEC_SNAPKV)],
                         ids=lambda c: f"{c[0].split(':')[0]}-{c[1]}-{c[2]}")
def test_weight_quantized_shards_equal_one_process(runs, case):
    """int4 (groups of 32) and int8 (a scale per row) weights, sliced code for code: within 1e-5 of one
    process through the torch backend (dequantize + matmul).  The C++ kernel rounds its activations to
    int8 per block of 32 (kernels/qlinear.py; the shards cut at whole blocks), so the row-parallel sums' 1e-7
    changes of the residual stream can move an activation by one int8 step (1/127 of its block's largest
    value): up to 0.05 measured on a logit (0.15 allowed), 5.3e-3 on average (1e-2 allowed)."""
    single, ranks = runs
    key = ("@".join(case), "b3")
    assert torch.equal(ranks[0][key]["logits"], ranks[1][key]["logits"])
    atol = 1e-5 if case[2] == "torch" else 0.15
    diff = (ranks[0][key]["logits"] - single[key]["logits"]).abs()
    assert diff.mean() < (1e-6 if case[2] == "torch" else 1e-2), diff.mean()
    torch.testing.assert_close(ranks[0][key]["logits"], single[key]["logits"], rtol=0, atol=atol)


class Rank1of2(tp.Shard):
    rank, size = 1, 2


def test_quantized_columns_are_cut_at_whole_groups():
    w = torch.randn(8, 192)
    for kind, group in (("int4", 32), ("int8", 0), ("int4", 192)):
        qw = quantize_weight(w, kind, group)
        part = tp.columns_of(qw, tp.span(192, Rank1of2()), "w")
        torch.testing.assert_close(dequantize(part), dequantize(qw)[:, 96:], rtol=0, atol=0)
    with pytest.raises(tp.TPError, match=r"scale groups of 64 input channels, which do not split into this "
                                         r"process's 96 columns; quantize with a --groupsize dividing 96 \(32, 96\)"):
        tp.columns_of(quantize_weight(w, "int4", 64), tp.span(192, Rank1of2()), "w")


def test_head_count_suggestions():
    with pytest.raises(tp.TPError, match="use --tp 8, 4, 2 or 1$"):
        tp.check_heads(ModelArgs(vocab_size=8, dim=64, n_layers=1, n_heads=8, n_kv_heads=8, intermediate_size=8), 3)


# --------------------------------------------------------------------------- the real model

@pytest.mark.slow
def test_chat_demo_under_tp3_answers_as_one_process(default_dir):
    """torchrun --nproc-per-node 3 engine.py --tp 3: the greedy chat answer of SmolLM2-135M-Instruct
    (3 KV heads: one per process) is the single process's."""
    chat = ["engine.py", "--checkpoint", str(default_dir), "--chat", "--prompt", "What is the capital of France?",
            "--max-new-tokens", "12"]
    one = subprocess.run([sys.executable, *chat], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    three = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", *chat, "--tp", "3"],
                           cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert one.returncode == 0 and three.returncode == 0, three.stderr[-2000:]
    assert "Paris" in one.stdout
    assert three.stdout == one.stdout
