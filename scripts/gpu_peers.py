"""Decode speed of this engine's GPU peers on a model configuration with random weights, each side in a process
of its own, and the summary table of scripts/gpu_check.sh.

    python scripts/gpu_peers.py --config data/configs/llama-3.1-8b/config.json --gpt-fast gpu/gpt-fast \\
        --sides gpt-fast,hf --batch 1 --context 4096 --steps 64 --json results/gpu_peers_8b.json
    python scripts/gpu_peers.py --summary results/gpu_*.json

Sides:
  gpt-fast  gpt-fast's own generate.py (a checkout given by --gpt-fast, never committed: scripts/gpu_check.sh
            --fetch puts it in the ignored gpu/ folder): its model.py built from the config (ModelArgs: sizes,
            rope base and llama3 scaling), its `generate()` called as its main() does with --compile
            (decode_one_token under torch.compile(mode="reduce-overhead", fullgraph=True); its own inductor
            settings, sampling at its defaults temperature 0.8, top_k 200).
  hf        transformers' LlamaForCausalLM from the config, its static cache
            (generation_config.cache_implementation = "static") and forward under torch.compile(mode=
            "reduce-overhead", fullgraph=True), greedy `generate`.
Both in bfloat16 with random weights (decode time does not depend on their values), on one prompt of --context
random ids repeated over --batch rows.  decode tok/s = batch x (N2 - N1) / (t2 - t1), t1 and t2 the fastest of two
timed generations each of N1 = --steps and N2 = 2 x --steps new tokens (interleaved), after an untimed one of N2
(which compiles and captures): the prompt's prefill cancels out.  Rows: {"side", "config", "batch_size", "context_length", "decode_tokens_per_s",
"decode_step_ms", "warmup_s", "device", "torch_version"} or {"side", "error"}.
--dry-run builds each side's configuration on the CPU and stops before the first CUDA call.
"""
from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("gpt-fast", "hf")


# --------------------------------------------------------------------------- the sides (in the subprocess)

def gptfast_args(config: dict, max_seq: int) -> dict:
    """gpt-fast's ModelArgs fields for an HF Llama config."""
    scaling = config.get("rope_scaling")
    return dict(block_size=max(max_seq, 2048), vocab_size=config["vocab_size"], n_layer=config["num_hidden_layers"],
                n_head=config["num_attention_heads"], n_local_heads=config["num_key_value_heads"],
                dim=config["hidden_size"], intermediate_size=config["intermediate_size"],
                rope_base=config.get("rope_theta", 10000.0), norm_eps=config["rms_norm_eps"],
                rope_scaling=None if not scaling else {k: scaling[k] for k in (
                    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")})


def timed(generate, batch: int, steps: int, sync) -> tuple[float, float]:
    """(decode tok/s, untimed first call's seconds) from generate(n_new_tokens) (module docstring)."""
    t = time.perf_counter()
    generate(2 * steps)
    sync()
    warm = time.perf_counter() - t
    times = {steps: float("inf"), 2 * steps: float("inf")}
    for n in (steps, 2 * steps) * 2:            # interleaved, fastest of two each
        sync()
        t = time.perf_counter()
        generate(n)
        sync()
        times[n] = min(times[n], time.perf_counter() - t)
    return batch * steps / (times[2 * steps] - times[steps]), warm


def sync_of(device: str):
    import torch
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def run_gptfast(spec: dict, dry_run: bool) -> dict:
    sys.path.insert(0, spec["gpt_fast"])        # its model.py and tokenizer.py, not this repository's
    import torch
    from model import ModelArgs, Transformer
    args = ModelArgs(**gptfast_args(spec["config"], spec["context"] + 2 * spec["steps"] + 1))
    if dry_run:         # (generate.py imports its tokenizers' packages, sentencepiece and tiktoken)
        return {"dry_run": f"gpt-fast ModelArgs {args.n_layer} layers, dim {args.dim}, {args.n_local_heads} KV heads"}
    import generate as G                        # gpt-fast's generate.py (sets its inductor options on import)
    device = spec["device"]
    with torch.device(device):
        model = Transformer(args)
    model = model.to(torch.bfloat16).eval()
    G.decode_one_token = torch.compile(G.decode_one_token, mode="reduce-overhead", fullgraph=True)  # its --compile
    prompt = torch.randint(0, args.vocab_size, (spec["context"],), device=device, dtype=torch.int)

    def gen(n: int):
        return G.generate(model, prompt, n, spec["batch"], interactive=False, draft_model=None,
                          temperature=0.8, top_k=200)
    return dict(zip(("decode_tokens_per_s", "warmup_s"), timed(gen, spec["batch"], spec["steps"], sync_of(device))))


def run_hf(spec: dict, dry_run: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**spec["config"])
    if dry_run:
        return {"dry_run": f"transformers LlamaConfig {config.num_hidden_layers} layers, dim {config.hidden_size}"}
    device = spec["device"]
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, config.vocab_size, (1, spec["context"]), device=device).repeat(spec["batch"], 1)

    def gen(n: int):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    with torch.inference_mode():
        return dict(zip(("decode_tokens_per_s", "warmup_s"),
                        timed(gen, spec["batch"], spec["steps"], sync_of(device))))


def worker_main(spec: dict) -> int:
    import torch
    row = {"side": spec["side"], "config": spec["config_path"], "batch_size": spec["batch"],
           "context_length": spec["context"], "torch_version": torch.__version__}
    try:
        run = run_gptfast if spec["side"] == "gpt-fast" else run_hf
        row.update(run(spec, spec["dry_run"]))
        if "decode_tokens_per_s" in row:
            row["decode_step_ms"] = 1000 * spec["batch"] / row["decode_tokens_per_s"]
            row["device"] = torch.cuda.get_device_name() if spec["device"].startswith("cuda") else spec["device"]
    except Exception as e:      # a side that fails is a row, never fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    print(json.dumps(row))
    return 0


# --------------------------------------------------------------------------- the driver

def run_side(side: str, a: argparse.Namespace) -> dict:
    """One side in a fresh process (cwd: the gpt-fast checkout for gpt-fast) -> its row."""
    spec = {"side": side, "config": json.loads(a.config.read_text()), "config_path": str(a.config),
            "batch": a.batch, "context": a.context, "steps": a.steps, "dry_run": a.dry_run, "device": a.device,
            "gpt_fast": str(a.gpt_fast.resolve()) if a.gpt_fast else ""}
    if side == "gpt-fast" and not (a.gpt_fast and (a.gpt_fast / "generate.py").is_file()):
        return {"side": side, "error": f"no gpt-fast checkout at {a.gpt_fast} (scripts/gpu_check.sh --fetch)"}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          cwd=spec["gpt_fast"] if side == "gpt-fast" else None, timeout=a.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"side": side, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}"}


def summary(paths: Sequence[str]) -> list[str]:
    """One line per row of the benchmark's and this script's JSON files: side, config, B, ctx, decode tok/s."""
    lines = [f"{'file':28} {'side':34} {'B':>3} {'ctx':>6} {'decode t/s':>11} {'graphs':>7}  note"]
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data if isinstance(data, list) else data.get("rows", []):
            side = r.get("side") or (f"ours {r.get('policy', '?')}" + (" kv" + str(r["kv_bits"]) if r.get("kv_bits") not in (None, 16) else "")
                                     + (" compiled" if r.get("compile") else " eager"))
            tps = r.get("decode_tokens_per_s")
            note = r.get("error") or r.get("dry_run") or ""
            lines.append(f"{Path(path).name[:28]:28} {side[:34]:34} {r.get('batch_size', '-'):>3} "
                         f"{r.get('context_length', '-'):>6} {'-' if tps is None else f'{tps:.1f}':>11} "
                         f"{r.get('static_decode_steps') if r.get('static_decode_steps') is not None else '-':>7}  {note}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--summary", nargs="+", metavar="JSON", help="print the table of these result files and exit")
    p.add_argument("--config", type=Path, help="an HF config.json (data/configs/, a checkpoint's)")
    p.add_argument("--sides", default="gpt-fast,hf", help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--gpt-fast", type=Path, default=ROOT / "gpu" / "gpt-fast", help="a gpt-fast checkout")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens")
    p.add_argument("--steps", type=int, default=64, help="N1 (N2 = 2 x N1; module docstring)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per side")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu checks a side's code on a tiny config")
    p.add_argument("--dry-run", action="store_true", help="build the configurations on the CPU; no CUDA call")
    p.add_argument("--json", type=Path, help="write the rows there")
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(json.loads(a.worker))
    if a.summary:
        print("\n".join(summary([f for pattern in a.summary for f in sorted(glob.glob(pattern)) or [pattern]])))
        return 0
    if a.config is None or not a.config.is_file():
        p.error(f"--config {a.config}: no such file")
    sides = a.sides.split(",")
    if any(s not in SIDES for s in sides) or a.batch < 1 or a.context < 1 or a.steps < 1:
        p.error(f"--sides of {', '.join(SIDES)}; --batch, --context and --steps at least 1")
    rows = [run_side(s, a) for s in sides]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        sys.path.insert(0, str(ROOT))
        import atomic_io
        atomic_io.write_json(a.json, rows, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
