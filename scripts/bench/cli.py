"""The command line: flags, their validation (exit 2 with one `error:` line, before the model is
loaded where possible), the run of the selected mode, Ctrl-C (exit 130, finished rows kept) and the
exit status (1 when a row errored)."""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

import engine
from bench.measure import MemoryMeter
from bench.modes import MODES, selected_mode
from bench.report import RowWriter, add_ratios, plot, print_header, print_storage_table, print_summary
from bench.roofline import measure_bandwidth
from bench.runner import Bench
from bench.specs import (KV_BITS, BenchmarkError, parse_int_list, parse_policies, require_positive,
                         with_reference)
from cache import PolicyError, policy_names
from cache.quantized import RESIDUAL, check_format
from checkpoint import CheckpointError
from runtime.steps import UsageError
import tp as tensor_parallel
from tp import TPError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
SPEC_EXAMPLE = "full; snapkv:budget=128; hshare@a:ratios=1/2-1/2-1/2"


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="HF/converted model directory or .gguf file (default: the SmolLM2-135M-Instruct checkout)")
    p.add_argument("--policies", action="append", metavar="SPEC[;SPEC...]",
                   help=f"policy specs NAME[@LABEL][:k=v,...] separated by ';', or the flag repeated "
                        f"(e.g. '{SPEC_EXAMPLE}'); @LABEL runs a policy again with other arguments; NAME may "
                        f"be STORAGE+READER; 'all' (the default) = every registered policy "
                        f"(now: {', '.join(policy_names())})")
    p.add_argument("--policy-args", metavar="REMOVED",
                   help="removed: refused with exit status 2; put the arguments in the --policies spec "
                        "(NAME:k=v,...)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated (default 1)")
    p.add_argument("--context-lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per run (memory mode: "
                   "generated tokens)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before the timed ones")
    p.add_argument("--kv-bits", default="16", help="comma-separated KV storage bits: 32 (float32), 16 (the compute "
                                                   "dtype, or --kv-dtype), 4, 2 (KIVI-packed)")
    p.add_argument("--kv-group-size", type=int, default=32, help="KIVI group G for --kv-bits 4|2 (default 32)")
    p.add_argument("--kv-residual", type=int, default=RESIDUAL,
                   help=f"KIVI full-precision residual R (default {RESIDUAL})")
    p.add_argument("--kv-dtype", choices=["bfloat16", "float16", "float32"],
                   help="storage dtype of the --kv-bits 16 rows of `full` (default: the compute dtype)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="torch.compile the decode step (Inductor, CPU and CUDA); 'both' = eager and "
                        "compiled rows side by side")
    p.add_argument("--compile-prefill", action="store_true",
                   help="compiled rows compile the prefill step too (default: eager prefill, faster on CPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prefill chunk length (as engine.generate)")
    p.add_argument("--prompt-file", type=Path, help="text file tokenized as the prompt (default: random ids)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(engine.DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--speedup-vs", metavar="NAME[@LABEL]",
                   help="add speedup_vs_NAME[@LABEL]: decode tok/s over that policy's, pair by pair in this run "
                        "(a spec not in --policies is added to them)")
    p.add_argument("--bandwidth-gbs", type=float,
                   help="read bandwidth for the bound column (default: measured at start-up; 0 = no bound)")
    exclusive = p.add_mutually_exclusive_group()
    for mode in MODES:
        mode.add_arguments(p, exclusive)
    engine.add_tp_flags(p)
    p.add_argument("--peers", metavar="llama.cpp,hf", help="e2e: also run these peer engines (scripts/peers.py, each "
                                                          "in a subprocess) at the batch-1 contexts and print ours / theirs")
    p.add_argument("--prefill-row", type=int, nargs="?", const=2048, metavar="TOKENS",
                   help="e2e: also time a batch-1 prefill of TOKENS (2048) tokens by the fp32 checkpoint, by ours on "
                        "the Q4_1 GGUF and by llama.cpp on the same file (scripts/peers.py, --repeats rounds)")
    p.add_argument("--json", type=Path, help="write the rows as a JSON list (atomically, after every row)")
    p.add_argument("--csv", type=Path, help="write the rows as CSV (atomically, after every row)")
    p.add_argument("--plot", type=Path, help="write a PNG plot (needs matplotlib)")
    return p


def check_options(o: argparse.Namespace) -> None:
    """Validate every flag and add the parsed values to `o` (batch_list, context_list, kv_bits_list,
    policy_list, reference, and what the modes add); raises BenchmarkError."""
    if o.policy_args is not None:
        raise BenchmarkError(f"--policy-args is no longer accepted: put each policy's arguments in its --policies "
                             f"spec, NAME[@LABEL]:k=v,..., specs separated by ';' or by repeating --policies "
                             f"(e.g. --policies '{SPEC_EXAMPLE}'); the items of --policy-args "
                             f"{o.policy_args!r} are already specs of that form")
    o.batch_list = parse_int_list(o.batch_sizes, "--batch-sizes")
    o.context_list = parse_int_list(o.context_lengths, "--context-lengths")
    o.kv_bits_list = parse_int_list(o.kv_bits, "--kv-bits")
    bad_bits = [b for b in o.kv_bits_list if b not in KV_BITS]
    if bad_bits:
        raise BenchmarkError(f"--kv-bits {bad_bits[0]}: use {', '.join(map(str, KV_BITS[:-1]))} or {KV_BITS[-1]}")
    check_kv_formats(o, None)
    require_positive(o, "decode_steps", "repeats", "prefill_chunk")
    if o.warmup_steps < 0:
        raise BenchmarkError("--warmup-steps must be >= 0")
    if o.prefill_row is not None and o.prefill_row < 1:
        raise BenchmarkError("--prefill-row must be at least 1 token")
    if o.compile_prefill and o.compile == "off":
        raise BenchmarkError("--compile-prefill needs --compile on or both")
    o.policy_list, o.reference = with_reference(parse_policies(o.policies or ["all"]), o.speedup_vs)
    for mode in MODES:
        mode.check(o)
    if o.tp > 1 and selected_mode(o).name not in ("e2e", "sweep"):
        raise BenchmarkError(f"--tp runs the end-to-end and --sweep-context modes only (not {selected_mode(o).name}: "
                             f"its processes would size or time their shards on their own)")
    if o.prompt_file is not None and not o.prompt_file.is_file():
        raise BenchmarkError(f"cannot read --prompt-file {o.prompt_file}")


def check_kv_formats(o: argparse.Namespace, head_dim: Optional[int]) -> None:
    """The KIVI group/residual of --kv-bits 4|2 are valid (for this head_dim once it is known)."""
    for bits in sorted(set(o.kv_bits_list) - {32, 16}):
        try:
            check_format(head_dim, bits, o.kv_group_size, o.kv_residual)
        except ValueError as e:
            raise BenchmarkError(str(e)) from None


def load(o: argparse.Namespace):
    """(model, tokenizer, prompt-file token ids or None), checked against the options."""
    model, tokenizer = engine.load_model(o.checkpoint, engine.resolve_device(o.device), o.dtype, tp=o.tp,
                                         tp_head=o.tp_head)
    o.compute_dtype = model.norm.weight.dtype      # the compute dtype (linear layers may be quantized)
    gc.freeze()     # the tokenizer's ~400k objects: each row's gc.collect() skips them (0.2 s a row)
    check_kv_formats(o, model.args.head_dim)
    file_ids = None
    if o.prompt_file:
        file_ids = tokenizer.encode(o.prompt_file.read_text())
        if not file_ids:
            raise BenchmarkError(f"--prompt-file {o.prompt_file} gives no tokens")
    return model, tokenizer, file_ids


def start(o: argparse.Namespace, model, tokenizer, file_ids, writer: RowWriter) -> Bench:
    """Measure the bandwidth, print the header, make the calibration files: the run's Bench."""
    device = model.output.weight.device
    meter = MemoryMeter(device)
    bandwidth = o.bandwidth_gbs if o.bandwidth_gbs is not None else measure_bandwidth(device)
    bench = Bench(model, o, writer, meter, bandwidth or None, file_ids)
    print_header(o, model, device, bandwidth, meter.kind, bench.weight_bytes)
    bench.prepare(tokenizer)
    return bench


def main(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> int:
    o = build_parser(description).parse_args(argv)
    try:
        return run(o)
    except (BenchmarkError, UsageError, CheckpointError, PolicyError, TPError, FileNotFoundError) as e:
        return tensor_parallel.fail(str(e))      # under --tp every process meets the same error
    finally:
        tensor_parallel.finish()


def quiet_followers(o: argparse.Namespace) -> None:
    """Under --tp only rank 0 prints and writes files; the others measure in lockstep, silently."""
    if not tensor_parallel.is_leader():
        o.json = o.csv = o.plot = None
        sys.stdout = sys.stderr = open(os.devnull, "w")


def run(o: argparse.Namespace) -> int:
    """main() after parsing (exceptions of bad input propagate to it)."""
    quiet_followers(o)
    check_options(o)
    model, tokenizer, file_ids = load(o)
    mode = selected_mode(o)
    # every (policy, batch specialisation) may need its own graph: never fall back to eager silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(o.policy_list) + 8)
    writer = RowWriter(o.json, o.csv, lambda rows: add_ratios(rows, o.reference))
    try:
        bench = start(o, model, tokenizer, file_ids, writer)
        mode.run(bench)
    except KeyboardInterrupt:
        writer.write()
        kept = sum(r.get("status") == "ok" for r in writer.rows)
        where = " and ".join(str(p) for p in (o.json, o.csv) if p) or "no file (use --json/--csv)"
        print(f"\ninterrupted: kept {len(writer.rows)} finished row(s) ({kept} measured) in {where}", file=sys.stderr)
        return 130
    print_summary(writer.rows)
    if mode.name == "e2e":
        print_storage_table(writer.rows)
    if o.peers and mode.name == "e2e":
        from peers import compare_with_rows
        compare_with_rows(writer.rows, o.peers, torch.get_num_threads(), o.decode_steps)
    if o.prefill_row and mode.name == "e2e":
        from peers import prefill_row
        prefill_row(torch.get_num_threads(), o.prefill_row, o.repeats)
    if o.plot:
        plot(writer.rows, o.plot, mode.name)
    return 1 if bench.errors else 0
