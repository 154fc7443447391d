"""Benchmark every KV-cache policy in the registry: end-to-end decode throughput, attention-operator
latency, decode cost versus context length, and the largest batch that fits a memory limit.

    OMP_WAIT_POLICY=ACTIVE python scripts/benchmark.py --checkpoint checkpoints/SmolLM2-135M-Instruct \\
        --policies 'full; streaming; h2o:budget=256,n_recent=128; hshare:preset=long,layer_ratio=0.5' \\
        --batch-sizes 1,8,16 --context-lengths 1024,2048,4096 --decode-steps 64 --kv-bits 16,4 \\
        --compile --repeats 3 --speedup-vs full --json out.json --csv out.csv --plot out.png

Policies: --policies takes the one spec syntax of every command (cache/spec.py),
NAME[@LABEL][:key=value,...], several specs separated by ';' or given by repeating the flag:
    --policies 'full; snapkv:budget=128,obs_window=16; hshare@a:ratios=1/2-1/2-1/2; hshare@b:ratios=1-1-1'
    --policies full --policies snapkv:budget=128 --policies snapkv+hshare:budget=1024,preset=short
'all' (the default) is every registered policy.  @LABEL runs the same policy again with other
arguments in the same run; STORAGE+READER composes a sparse reader over a storage policy.  A comma
separates one spec's arguments, never specs.  Every spec is validated before the model is loaded
(exit status 2).  The old --policy-args 'name:k=v;...' map is refused with a message (write the
arguments into the spec).

Modes (one per run):
  (default)            end-to-end: prefill a prompt of exactly C tokens for B sequences, then time
                       --decode-steps greedy decode steps (prefill excluded); policies x batch sizes
                       x contexts x kv-bits x compile.
  --op attention       attention-operator latency only: dense SDPA over the whole cache ("dense_sdpa")
                       next to each policy's decode attention (its `begin` + `decode` hooks of all
                       layers, on the q/k/v of a real decode step after a real prefill), like HShare's
                       Table 4.  Reported per layer and per step (all layers).
  --sweep-context [R]  decode step time versus context length (R = START:STOP doubling, or a list;
                       default 256:8192, capped to the model's context): the cost-growth curve.
  --memory-limit L     largest batch per policy that fits L (e.g. 8GiB, or a list 4GiB,8GiB) for a
                       prompt of each --context-lengths plus --decode-steps generated tokens.
  --soak N             long run: N decode steps per policy after a prompt of each --context-lengths,
                       resident memory (RSS), tokens/s and NaN/inf logits per --soak-every (500)
                       steps; bounded policies must keep RSS within 2% after the first window
                       (details: scripts/bench/soak.py).  Positions may run past the model's context.

Measurement:
  * Prefill runs in --prefill-chunk chunks, or in one pass for policies that compress the prompt
    (`prefill_in_one_pass`), as engine.generate does.
  * Synthetic prompts are random token ids (seeded, identical for every policy), or --prompt-file
    (tokenized, repeated if short, cut to the exact length; sequence b starts at a different offset).
  * Each configuration gets one untimed warm-up run first (the full-size run when compiled, so
    compilation and any shape specialisation happen before timing; a 64-token run when eager).
    Every timed run then does its own prefill and `--warmup-steps` untimed decode steps.
  * Repeats are interleaved: round r runs every configuration of a (batch, context) group once, so
    noise on a shared machine hits all policies alike; the median of the repeats is reported.
  * Decode tok/s = B * decode_steps / wall time of the decode loop (argmax sampling included,
    prefill excluded); per sequence = decode_steps / time.
  * Bandwidth bound: bytes one decode step must read = unique weight bytes + the KV bytes the policy
    reads per step (`cache.kv_bytes()["read_per_step"]`, mean of the start and end of the timed
    loop), divided by the read bandwidth measured at start-up (scripts/compare_hf.py's median of
    streaming reads; --bandwidth-gbs overrides).  bandwidth_bound_tokens_per_s = B * bw / bytes.
  * Peak memory per row: CPU = peak RSS of the process during the row (VmHWM, reset per run by
    writing 5 to /proc/self/clear_refs; it includes weights and the runtime), CUDA = max allocated.
  * --compile: the decode step from runtime.steps.compiled_steps (Inductor; on CUDA a GraphDecode: CUDA graphs
    replayed over a cache with a static decode step, one per batch size and read bucket, captured in the
    full-size warm-up); --compile-prefill compiles the prefill step too.  `--compile both` runs eager and
    compiled rows side by side and adds compile_speedup.  decode_recompiles counts graphs compiled during timed
    decode loops (torch._dynamo counters); it must be 0.  On CUDA, cuda_graphs_recorded counts CUDA graphs
    recorded inside the timed loops (cudagraph trees): it must be 0 (a capture inside a timed loop is a
    failure), and static_decode_steps the timed steps that replayed one (the others ran plain Inductor: a
    policy without a static step).
  * Memory-limit model: total(B) = base + state_fixed + B * state_per_seq + workspace_fixed +
    B * workspace_per_seq, where base = process RSS (CUDA: allocated bytes) with the model loaded and
    warmed up and no cache; state = bytes of every tensor the policy object holds after
    setup_caches (KV buffers and bookkeeping) plus the RoPE tables; workspace = peak minus resident
    during a real prefill + decode of the prompt.  Both are measured at B=1 and at a probe batch
    P >= 2 (at least 2048 prompt tokens in all, at most 64) and fitted linearly.  The answer is
    floor((limit * (1 - headroom) - base - fixed) / per_seq) (model_batch_size); --memory-headroom
    (default 5%) keeps room for allocator slack.  Then, while a run fits this machine and is
    estimated to take at most --verify-seconds, that batch is actually run (prompt + generation) and
    the line refitted through the two largest real peaks (B=1's included), for at most --verify-runs
    runs per limit (later limits start from the runs already made);
    max_batch_size is the largest run batch whose peak stayed within the limit (verified = true),
    else the model's answer (verified = null: not run; false: runs exceeded the limit).  Workspace
    is not always linear in B (a one-pass prefill at B=9 needed 12% more than the B=1/B=2 line), so
    an unverified answer is an estimate.

JSON (--json): a list of row objects, rewritten atomically (tmp file + os.replace) after every
finished row, so an interrupted run (Ctrl-C: exit status 130) keeps every finished row.
--csv writes the same rows.  Keys of end-to-end and sweep rows:
  mode ("e2e"|"sweep"), policy (NAME@LABEL, or NAME, of the spec), policy_args (the spec's
  k=v,... text, "" for none), policy_config (describe()),
  batch_size, context_length, kv_bits, decode_steps, warmup_steps, repeats,
  prefill_tokens_per_s, decode_tokens_per_s (aggregate over the batch, prefill excluded),
  decode_tokens_per_s_per_seq, decode_step_ms, decode_tokens_per_s_samples (one per repeat),
  kv_bytes_allocated, kv_bytes_live (end of the run), kv_bytes_read_per_step, weight_bytes,
  bytes_per_step, read_bandwidth_gbs, bandwidth_bound_tokens_per_s, fraction_of_bound,
  peak_memory_bytes, peak_memory_kind, decode_recompiles, cuda_graphs_recorded and static_decode_steps (null off
  CUDA), device, dtype, torch_version,
  compile (bool), compile_mode, omp_wait_policy, num_threads, cpu, prompt, status ("ok"|"skipped"|
  "error"), error (the reason, or null), and with --speedup-vs NAME: speedup_vs_NAME (decode tok/s
  over NAME's in the same run, same batch/context/kv-bits/compile), with --compile both:
  compile_speedup.  Skipped/error rows carry null measurements.
Attention rows (mode "attention"): policy ("dense_sdpa" = the reference), batch_size,
  context_length, kv_bits, n_layers, attention_us_per_layer, attention_ms_per_step (medians),
  kv_bytes_read_per_step, bandwidth_bound_us_per_layer, speedup_vs_dense_sdpa, device, dtype, ...
Soak rows (mode "soak"): policy, policy_args, kv_bits, batch_size, context_length, decode_steps (N),
  soak_every, soak_windows (per window: step, rss_bytes, tokens_per_s, nonfinite_steps),
  rss_baseline_bytes (after the first window), rss_max_drift (fraction), tokens_per_s_first /
  tokens_per_s_last (medians of windows 2-4 / of the last three), tokens_per_s_ratio, nonfinite_steps,
  kv_bytes_allocated, beyond_context, soak_failures (the failed checks; non-empty: exit status 1).
Memory rows (mode "memory"): policy, policy_args, kv_bits, context_length, decode_steps,
  memory_limit_bytes, max_batch_size, model_batch_size, predicted_bytes (of model_batch_size),
  base_bytes, state_bytes_fixed, state_bytes_per_seq, kv_bytes_allocated_per_seq,
  workspace_bytes_fixed, workspace_bytes_per_seq, probe_batch_size, verified (bool, or null when
  not run), verified_batch_size, verified_peak_bytes, verified_within_limit, prediction_error
  (model_batch_size's real peak / predicted - 1), verify_runs ([batch, peak] pairs), verify_note.

CPU: set OMP_WAIT_POLICY=ACTIVE (recommended; the header prints the setting in effect): PyTorch's
OpenMP threads otherwise sleep between ops, which costs milliseconds per op on small CPUs.  Run on
an otherwise idle machine; the median of interleaved repeats damps but cannot remove noise.
--kv-bits 32,16,4,2 runs every configuration at each storage: fp32, 16-bit (--kv-dtype, e.g.
bfloat16; only `full` stores K/V in a dtype other than the compute dtype), KIVI-packed with
--kv-group-size/--kv-residual (pod has no packed format); rows a policy cannot store that way are
reported as skipped.  With several storages an e2e run ends with the table of decode tok/s by
policy x storage (x the policy's first storage, x full's at the same storage).
Peers: --peers llama.cpp,hf adds batch-1 decode ratios against those engines; --prefill-row [TOKENS]
a batch-1 prefill of TOKENS (2048) tokens by the fp32 checkpoint, by ours on the Q4_1 GGUF as stored
and by llama.cpp on the same file (scripts/peers.py: each side in its own subprocess, --repeats
interleaved rounds), printed as tok/s with the ratios over our fp32 and over llama.cpp.

Code: scripts/bench/ (specs, measure, roofline, report, one module per mode; see its __init__.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench import cli  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark with these arguments; the exit status (0, 1 if a row errored, 2 for bad
    input, 130 on Ctrl-C with the finished rows kept)."""
    return cli.main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
