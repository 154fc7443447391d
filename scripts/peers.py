"""Batch-1 decode speed of this engine next to its peers, each run in its own subprocess.

    OMP_WAIT_POLICY=ACTIVE python scripts/peers.py --contexts 512,2048,4096 --threads 2 \\
        --ours checkpoints/SmolLM2-135M-Instruct --ours checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --peers llama.cpp,hf

Rows: one per (side, context).  Sides: `ours:CHECKPOINT[:k=v,...]` (options: compile=1 [compile_prefill=1], policy=NAME,
policy_args=k=v;k=v, kv_bits=4 or 2 (KIVI storage at the engine's default G 32, R 128),
weights=auto|float, dtype=bfloat16, qlinear_arith=int|avx2|vnni (the instructions of the quantized layers'
one arithmetic: KVC_QLINEAR_ARITH in the side's process)), `llama.cpp` (llama-cpp-python on the GGUF, --gguf),
`llama-server` (llama.cpp's C++ server, --llama-server, one slot: one completion, timed by its own report), `hf`
(transformers LlamaForCausalLM on the float directory, --hf).  Every side gets the same prompt token
ids (random ids of --seed, or --text FILE tokenized), the same thread count (torch.set_num_threads /
llama.cpp n_threads and n_threads_batch, and OMP_NUM_THREADS) and the environment's OMP_WAIT_POLICY;
decode tok/s = timed greedy single-token steps after --warmup untimed ones, prefill excluded;
prefill tok/s = the prompt's tokens / the time of its prefill (one pass of run_prefill, batch 1).  The
sides run interleaved --repeats times (medians), so drift on a shared machine hits every side alike;
each run is a fresh process, which also gives its peak RSS.

A side that crashes (e.g. llama-cpp-python built natively segfaults on batched eval on AMX Xeons) or is
not installed is reported in its row, never fatal.  From Python: `decode_tps(side, ids, steps, threads)`
-> {"tok_s", "peak_rss", "model_rss", "prefill_s", "compile_s"} or {"error"}.  peak_rss is the process's
peak; model_rss the part of it above the RSS once the side's runtime was imported (torch and this
engine's C++ kernels, llama_cpp, transformers): the model's own memory, weights + cache + activations
+ tokenizer, without the ~230 MB that `import torch` costs every side.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import atomic_io  # noqa: E402

PEERS_EXTRA = "pip install -e '.[peers]'  (llama-cpp-python builds llama.cpp from source: see docs/design.md, Peers)"
DEFAULT_GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------- workers (in the subprocess)

_runtime_rss = 0


def runtime_loaded() -> None:
    """Mark the point where the side's libraries are imported and its model not yet loaded."""
    global _runtime_rss
    _runtime_rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))


def timed_decode(step, first_token: int, steps: int, warmup: int) -> float:
    """tok/s of `steps` calls of step(token) -> next token, after `warmup` untimed ones."""
    tok = first_token
    for _ in range(warmup):
        tok = step(tok)
    t = time.perf_counter()
    for _ in range(steps):
        tok = step(tok)
    return steps / (time.perf_counter() - t)


def run_llama_cpp(opts: dict, ids: list[int], steps: int, warmup: int, threads: int) -> dict:
    import numpy as np
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(json.dumps({"error": f"llama-cpp-python is not installed: {PEERS_EXTRA}"}))
    runtime_loaded()
    llm = llama_cpp.Llama(str(opts["path"]), n_ctx=len(ids) + steps + warmup + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)
    t = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - t

    def last_argmax() -> int:   # without logits_all, llama-cpp-python 0.3 keeps no scores: read the context's
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    def step(tok: int) -> int:
        llm.eval([tok])
        return last_argmax()
    return {"tok_s": timed_decode(step, last_argmax(), steps, warmup), "prefill_s": prefill}


def run_llama_server(opts: dict, ids: list[int], steps: int, warmup: int, threads: int) -> dict:
    """llama.cpp's C++ llama-server (opts["binary"]) on the GGUF, one slot, started and stopped as
    scripts/loadtest.py starts its servers (loadtest.Started): one greedy completion of warmup + steps tokens (EOS
    ignored) after the prompt ids, timed by the server's own report (timings: its decode tok/s over every generated
    token, its prompt time); peak RSS the server's."""
    import urllib.request
    sys.path.insert(0, str(ROOT / "scripts"))
    from loadtest import Started, free_port
    binary = Path(opts["binary"] or "")
    if not binary.is_file():
        raise SystemExit(json.dumps({"error": f"no llama-server at {str(binary)!r}: give --llama-server "
                                              f"(scripts/setup_peers.sh builds one)"}))
    port = free_port()
    command = [str(binary), "-m", opts["path"], "-t", str(threads), "-tb", str(threads), "-np", "1",
               "-c", str(len(ids) + steps + warmup + 8), "--host", "127.0.0.1", "--port", str(port)]
    try:
        server = Started("llama-server", command, dict(os.environ), port, 300)
    except RuntimeError as e:
        raise SystemExit(json.dumps({"error": str(e)}))
    try:
        body = json.dumps({"prompt": ids, "n_predict": warmup + steps, "ignore_eos": True, "temperature": 0,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(server.url + "/completion", body, {"Content-Type": "application/json"})
        timings = json.load(urllib.request.urlopen(request, timeout=1800))["timings"]
        hwm = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{server.proc.pid}/status")
                   if line.startswith("VmHWM"))
    finally:
        server.stop()
    return {"tok_s": timings["predicted_per_second"], "prefill_s": timings["prompt_ms"] / 1000,
            "peak_rss": hwm, "model_rss": hwm}


def run_hf(opts: dict, ids: list[int], steps: int, warmup: int, threads: int) -> dict:
    import torch
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        raise SystemExit(json.dumps({"error": "transformers is not installed: pip install -e '.[test]'"}))
    runtime_loaded()
    torch.set_num_threads(threads)
    path = Path(opts["path"])
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = LlamaForCausalLM.from_pretrained(path.parent if kw else path, dtype=torch.float32, **kw).eval()
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf(torch.tensor([ids]), use_cache=True)
        prefill = time.perf_counter() - t
        state = {"past": out.past_key_values}

        def step(tok: int) -> int:
            o = hf(torch.tensor([[tok]]), past_key_values=state["past"], use_cache=True)
            state["past"] = o.past_key_values
            return int(o.logits[0, -1].argmax())
        return {"tok_s": timed_decode(step, int(out.logits[0, -1].argmax()), steps, warmup), "prefill_s": prefill}


def run_ours(opts: dict, ids: list[int], steps: int, warmup: int, threads: int) -> dict:
    from runtime.steps import compiled_steps, decode_step, prefill_step, run_decode, run_prefill, warm_up, warmup_length
    import torch
    import engine
    from cache import make_policy
    from cache.kv_dtype import kv_storage
    from cache.quantized import GROUP, RESIDUAL
    from kernels.cpu import cpu_kernels_available
    cpu_kernels_available()
    runtime_loaded()
    torch.set_num_threads(threads)
    model, _ = engine.load_model(opts["path"], "cpu", opts.get("dtype"), opts.get("weights", "auto"))

    def new_policy():
        p = make_policy(opts.get("policy", "full"), opts.get("policy_args", "").replace(";", ","))
        return kv_storage(p, int(opts["kv_bits"]), GROUP, RESIDUAL) if "kv_bits" in opts else p
    prefill, decode, compile_s = prefill_step, decode_step, None
    tokens = torch.tensor([ids])
    if opts.get("compile") in ("1", "true"):
        prefill, decode = compiled_steps(torch.device("cpu"), opts.get("compile_prefill") in ("1", "true"))
        t = time.perf_counter()
        warm_up(model, prefill, decode, tokens[:, :warmup_length(new_policy())], new_policy())
        compile_s = time.perf_counter() - t
    model.setup_caches(1, len(ids) + steps + warmup + 8, new_policy())
    pos = torch.arange(len(ids))[None]
    with torch.inference_mode():
        t = time.perf_counter()
        logits = run_prefill(model, tokens, pos, prefill)
        prefill_s = time.perf_counter() - t
        state = {"i": 0}

        def step(tok: int) -> int:
            i = state["i"]
            out = run_decode(model, torch.tensor([[tok]]), torch.tensor([[len(ids) + i]]), i, decode)
            state["i"] = i + 1
            return int(out[0].argmax())
        return {"tok_s": timed_decode(step, int(logits[0].argmax()), steps, warmup), "prefill_s": prefill_s,
                "compile_s": compile_s}


WORKERS = {"llama.cpp": run_llama_cpp, "llama-server": run_llama_server, "hf": run_hf, "ours": run_ours}


def worker_main(spec: dict) -> int:
    """Subprocess entry: run one side, print one JSON line."""
    ids = json.loads(Path(spec["ids_file"]).read_text())
    out = WORKERS[spec["kind"]](spec["opts"], ids, spec["steps"], spec["warmup"], spec["threads"])
    if "peak_rss" not in out:                  # (llama-server reports its own process's)
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["model_rss"] = out["peak_rss"] - _runtime_rss
    print(json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- the parent

SIDE_OPTIONS = ("compile", "compile_prefill", "policy", "policy_args", "kv_bits", "weights", "dtype", "qlinear_arith")


def parse_side(text: str, gguf: Path, hf: Path, llama_server: Optional[Path] = None) -> dict:
    """'llama.cpp' | 'llama-server' | 'hf' | 'ours:PATH[:k=v,...]' -> {"kind", "label", "opts"}."""
    if text in ("llama.cpp", "hf"):
        return {"kind": text, "label": text, "opts": {"path": str(gguf if text == "llama.cpp" else hf)}}
    if text == "llama-server":
        return {"kind": text, "label": text, "opts": {"path": str(gguf), "binary": llama_server and str(llama_server)}}
    kind, _, rest = text.partition(":")
    if kind != "ours" or not rest:
        raise ValueError(f"unknown side {text!r}: use llama.cpp, llama-server, hf or ours:CHECKPOINT[:k=v,...]")
    path, _, extra = rest.partition(":")
    opts = {"path": path}
    for item in filter(None, extra.split(",")):
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"side option {item!r} is not k=v")
        if k not in SIDE_OPTIONS:
            raise ValueError(f"unknown side option {k!r}: use {', '.join(SIDE_OPTIONS)}")
        opts[k] = v
    label = "ours " + Path(path).name + (" " + extra if extra else "")
    return {"kind": "ours", "label": label, "opts": opts}


def decode_tps(side: dict, ids: list[int], steps: int = 32, threads: int = 2, warmup: int = 4,
               timeout: float = 1800) -> dict:
    """Run one side in a subprocess -> its JSON result, or {"error": ...} if it failed or crashed."""
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        atomic_io.write_json(ids_file, ids)
        spec = {**side, "ids_file": str(ids_file), "steps": steps, "warmup": warmup, "threads": threads}
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if "qlinear_arith" in side["opts"]:
            env["KVC_QLINEAR_ARITH"] = side["opts"]["qlinear_arith"]
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    return worker_result(proc)


def worker_result(proc: subprocess.CompletedProcess) -> dict:
    """The worker's JSON line, or {"error": ...} naming the signal or the last line of its stderr."""
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    if proc.returncode < 0:
        return {"error": f"crashed ({signal.Signals(-proc.returncode).name})"}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit status {proc.returncode}: {tail[:300]}"}


def prompt_ids(args, vocab_from: Path) -> list[int]:
    """--text FILE tokenized (the checkpoint's tokenizer), else seeded random ids below 32000."""
    n = max(args.contexts)
    if args.text:
        from checkpoint import read_checkpoint
        _, _, tok = read_checkpoint(vocab_from)
        ids = tok.encode(Path(args.text).read_text())
        if len(ids) < n:
            raise ValueError(f"{args.text} gives {len(ids)} tokens, need {n}")
        return ids[:n]
    import random
    rng = random.Random(args.seed)
    return [rng.randrange(100, 32000) for _ in range(n)]


def run(args) -> list[dict]:
    sides = [parse_side("ours:" + s, args.gguf, args.hf) for s in args.ours] + \
        [parse_side(p, args.gguf, args.hf, args.llama_server) for p in filter(None, args.peers.split(","))]
    ids = prompt_ids(args, args.gguf if args.gguf.exists() else args.hf)
    samples = {(s["label"], c): [] for s in sides for c in args.contexts}
    results = {}
    for r in range(args.repeats):
        for c in args.contexts:
            for s in sides:
                res = decode_tps(s, ids[:c], args.steps, args.threads, args.warmup)
                results.setdefault((s["label"], c), res)
                if "tok_s" in res:
                    samples[(s["label"], c)].append(res)
                print(f"# round {r + 1} ctx {c} {s['label']}: " + (f"{res['tok_s']:.1f} tok/s" if "tok_s" in res
                                                                  else res["error"]), file=sys.stderr, flush=True)
    rows = []
    for (label, c), got in samples.items():
        row = {"side": label, "context": c, "runs": len(got)}
        if got:
            row.update({k: statistics.median(x[k] for x in got) for k in ("tok_s", "peak_rss", "model_rss", "prefill_s")})
            compile_s = [x["compile_s"] for x in got if x.get("compile_s") is not None]
            row["compile_s"] = compile_s or None
        else:
            row["error"] = results[(label, c)]["error"]
        rows.append(row)
    return rows


def compare_with_rows(ours: list[dict], peers: str, threads: int, steps: int, gguf: Path = DEFAULT_GGUF,
                      hf: Path = DEFAULT_HF, seed: int = 0) -> None:
    """The benchmark's --peers hook: measure `peers` at the contexts of the batch-1 rows `ours` (dicts
    with policy, context_length, decode_tokens_per_s, ...) and print each of ours over each peer."""
    contexts = sorted({r["context_length"] for r in ours if r.get("batch_size") == 1 and r.get("decode_tokens_per_s")})
    if not contexts:
        return
    args = argparse.Namespace(ours=[], peers=peers, gguf=gguf, hf=hf, contexts=contexts, steps=steps, warmup=4,
                              threads=threads, repeats=1, text=None, seed=seed)
    got = {(r["side"], r["context"]): r for r in run(args)}
    print(f"# peers (scripts/peers.py, {threads} threads, same OMP_WAIT_POLICY), batch 1: ours / theirs")
    for r in ours:
        if r.get("batch_size") != 1 or not r.get("decode_tokens_per_s"):
            continue
        c, tps = r["context_length"], r["decode_tokens_per_s"]
        parts = []
        for p in filter(None, peers.split(",")):
            x = got.get((p, c), {})
            parts.append(f"{p} {x['tok_s']:.1f} tok/s -> {tps / x['tok_s']:.2f}x" if "tok_s" in x
                         else f"{p}: {x.get('error', 'not measured')}")
        label = f"{r['policy']}{' compiled' if r.get('compile') else ''} kv{r.get('kv_bits', 16)}"
        print(f"#   {label:32s} ctx {c:5d} {tps:7.1f} tok/s | " + " | ".join(parts))


def prefill_row(threads: int, context: int = 2048, repeats: int = 1, gguf: Path = DEFAULT_GGUF,
                hf: Path = DEFAULT_HF) -> list[dict]:
    """The benchmark's --prefill-row: batch-1 prefill of `context` tokens by our fp32 checkpoint, by ours
    on the Q4_1 GGUF as stored (integer prefill arithmetic where the CPU has it), and by llama.cpp on
    the same file, each in its own subprocess (`run`), rounds interleaved; prints tok/s and the ratios;
    returns the rows (prefill_tok_s added)."""
    args = argparse.Namespace(ours=[str(hf), str(gguf)], peers="llama.cpp", gguf=gguf, hf=hf, contexts=[context],
                              steps=2, warmup=0, threads=threads, repeats=repeats, text=None, seed=0)
    rows = run(args)
    for r in rows:
        r["prefill_tok_s"] = context / r["prefill_s"] if r.get("prefill_s") else None
    fp32, q41, cpp = (rows[i].get("prefill_tok_s") for i in range(3))
    print(f"# prefill, batch 1, {context} tokens ({threads} threads, same OMP_WAIT_POLICY, medians of {repeats}): "
          "tok/s (x our fp32, x llama.cpp)")
    for r in rows:
        v = r["prefill_tok_s"]
        print(f"{r['side']:58s} " + (f"{v:8.1f} ({fmt_ratio(v, fp32)}, {fmt_ratio(v, cpp)})" if v
                                     else f"error: {r.get('error')}"), flush=True)
    if q41 and cpp:
        print(f"# Q4_1 GGUF as stored: {fmt_ratio(q41, cpp)} llama.cpp's prefill, {fmt_ratio(q41, fp32)} our fp32's",
              flush=True)
    return rows


def fmt_ratio(num: Optional[float], den: Optional[float]) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def print_table(rows: list[dict], base_sides: Sequence[str]) -> None:
    by = {(r["side"], r["context"]): r for r in rows}
    print(f"{'side':58s} {'ctx':>5s} {'tok/s':>7s} " + " ".join(f"{'/' + b[:10]:>11s}" for b in base_sides)
          + f" {'peak RSS':>9s} {'model':>7s} {'prefill':>8s} " + " ".join(f"{'/' + b[:10]:>11s}" for b in base_sides))
    for r in rows:
        if "error" in r:
            print(f"{r['side']:58s} {r['context']:5d}  error: {r['error']}")
            continue
        refs = [by.get((b, r["context"]), {}) for b in base_sides]
        ratios = [f"{r['tok_s'] / ref['tok_s']:10.2f}x" if "tok_s" in ref else f"{'-':>11s}" for ref in refs]
        pre = [f"{ref['prefill_s'] / r['prefill_s']:10.2f}x" if "prefill_s" in ref else f"{'-':>11s}" for ref in refs]
        print(f"{r['side']:58s} {r['context']:5d} {r['tok_s']:7.1f} " + " ".join(ratios)
              + f" {r['peak_rss'] / 2**20:7.0f}MB {r['model_rss'] / 2**20:5.0f}MB"
              + f" {r['context'] / r['prefill_s']:8.1f} " + " ".join(pre))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", action="append", default=[], metavar="CHECKPOINT[:k=v,...]",
                   help="a side of this engine (repeatable), e.g. ckpt.gguf:compile=1,policy=snapkv,"
                        "policy_args=budget=256")
    p.add_argument("--peers", default="llama.cpp,hf",
                   help="comma-separated: llama.cpp, llama-server (--llama-server), hf ('' for none)")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the GGUF llama.cpp and llama-server run")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (the llama-server side)")
    p.add_argument("--hf", type=Path, default=DEFAULT_HF, help="the float directory (or GGUF) transformers runs")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 4096])
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds (medians)")
    p.add_argument("--text", help="text file for the prompt (default: random ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    args = p.parse_args(argv)
    try:
        sides = [parse_side("ours:" + s, args.gguf, args.hf) for s in args.ours]
        rows = run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# threads {args.threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, batch 1, "
          f"{args.steps} timed decode steps (+{args.warmup}), {args.repeats} round(s), prompt "
          f"{args.text or f'random ids (seed {args.seed})'}")
    print_table(rows, [s for s in ("llama.cpp", "llama-server", "hf") if s in args.peers.split(",")] +
                ([sides[0]["label"]] if sides else []))
    if args.json:
        atomic_io.write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
