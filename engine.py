"""Generate text with a Llama-family model and a pluggable KV-cache policy.

    python engine.py --checkpoint checkpoints/SmolLM2-135M-Instruct --chat --prompt "Hi"   # printed as generated
    python engine.py --checkpoint checkpoints/SmolLM2-135M-Instruct --interactive          # a chat in the terminal

Run as a script, this sets OMP_WAIT_POLICY=ACTIVE unless you set it: PyTorch's OpenMP
threads otherwise sleep between ops, which costs milliseconds per op on small CPUs.
"""
from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

import torch

from cache import PolicyError, make_policy, policy_names
from cache.full import FullCache
from cache.kv_dtype import kv_storage
from cache.quantized import GROUP, RESIDUAL, check_format
from checkpoint import WEIGHTS, CheckpointError, build_model, read_checkpoint, release_freed_memory
from model import Transformer
from runtime.context import SENTINEL, Context, answer_questions, chat_pieces, prefill_context
from runtime.stats import GenerationResult, format_stats, generation_stats
from runtime.steps import (Sampler, UsageError, compiled_steps, decode_step, graph_report, left_pad, prefill_step,
                           run_decode, run_prefill, until_eos, warm_up, warmup_length)
from tokenizer import TextStream, Tokenizer
import tp as tensor_parallel
from tp import TPError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- loading

def resolve_device(device: Optional[str]) -> torch.device:
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UsageError(f"unsupported device {device!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA GPU is available")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {device}; use cpu or cuda")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UsageError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise UsageError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(checkpoint, device="cpu", dtype=None, weights: str = "auto", tp: int = 1,
               tp_head: str = "auto") -> tuple[Transformer, Tokenizer]:
    """Load a HuggingFace/converted/quantized directory or a .gguf file -> (model, tokenizer).

    weights="auto": quantized weights run as stored (a `python quantize.py` directory; a GGUF file's
    Q8_0/Q4_0/Q4_1 tensors, repacked without rounding); "float": everything dequantized to `dtype`.
    With tp > 1 (under torchrun) the model is this process's shard (tp.py; TPError for a bad launch or
    head count)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    args, tensors, tokenizer = read_checkpoint(checkpoint, weights)
    args.checkpoint = str(checkpoint)
    tensor_parallel.check(args, tp)        # a bad --tp or launch fails before anything is built
    if tp > 1:
        model = tensor_parallel.build(args, tensors, device, dtype, tp, tp_head)
    else:
        model = build_model(args, tensors, device, dtype, consume=True)
    del tensors
    release_freed_memory()
    return model, tokenizer


# --------------------------------------------------------------------------- generation

def encode_prompts(tokenizer: Tokenizer, prompts: Sequence, chat: bool) -> list[list[int]]:
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            if not p.strip():
                raise UsageError("empty prompt")
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = tokenizer.encode(p)
        else:
            ids = list(p)
        if not ids:
            raise UsageError("empty prompt")
        encoded.append(ids)
    return encoded


def check_length(T: int, max_new_tokens: int, max_seq_length: Optional[int], context: int) -> int:
    """The cache length a request of T prompt tokens + max_new_tokens needs (UsageError if it does not fit)."""
    if max_new_tokens < 1:
        raise UsageError("max_new_tokens must be at least 1")
    needed = T + max_new_tokens
    if max_seq_length is not None and needed > max_seq_length:
        raise UsageError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                         f"exceeds --max-seq-length {max_seq_length}")
    max_seq_length = max_seq_length or needed
    if max_seq_length > context:
        raise UsageError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {needed} "
                         f"exceeds the model's context length {context}" if needed > context else
                         f"--max-seq-length {max_seq_length} exceeds the model's context length {context}")
    return max_seq_length


def decode_loop(model: Transformer, first: torch.Tensor, pos: torch.Tensor, max_new_tokens: int, sampler: Sampler,
                eos: torch.Tensor, pad: int, decode, stop_check_every: int,
                on_token: Optional[Callable[[torch.Tensor], None]] = None) -> tuple[torch.Tensor, int]:
    """Greedy/sampled decode after the prompt: first [B] (the prefill's token), pos [B, 1] its position
    -> (tokens [B, max_new_tokens] with pad after each sequence's EOS, decode steps run).  A sequence
    stops at its own EOS; the loop ends when all have (checked every `stop_check_every` steps, the
    loop's only host sync).  on_token, if given, gets each step's tokens [B] (first
    included) as they are sampled (reading them is a host sync per step)."""
    B = first.shape[0]
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=first.device)
    out[:, 0] = token = first
    if on_token is not None:
        on_token(token)
    done = torch.isin(token, eos)
    steps = 0
    for i in range(1, max_new_tokens):
        logits = run_decode(model, token[:, None], pos, i - 1, decode)
        token = torch.where(done, pad, sampler(logits))
        out[:, i] = token
        if on_token is not None:
            on_token(token)
        done |= torch.isin(token, eos)
        pos = pos + 1
        steps += 1
        if i % stop_check_every == 0 and bool(done.all()):
            break
    return out, steps


def generate(model: Transformer, tokenizer: Tokenizer, prompts: Sequence, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             seed: Optional[int] = None, policy=None, max_seq_length: Optional[int] = None,
             chat: bool = False, compile: bool = False, prefill_chunk: int = 1024,
             stop_check_every: int = 8, compile_prefill: bool = False,
             on_token: Optional[Callable[[torch.Tensor], None]] = None,
             context: Optional[Context] = None) -> GenerationResult:
    """Generate for a batch of prompts (str or token-id lists, any lengths).

    With `context` (from prefill_context) the prompts are questions about that compressed context, each
    appended to a copy of its rows (`answer_questions`; policy, max_seq_length, chat and compile are the
    context's then, and must be left at their defaults).

    Prompts are left-padded to a common length; every sequence keeps its own positions
    (0 at its first real token) and padding is never attended.  Each sequence stops at its
    own EOS; the loop ends when all have (checked every `stop_check_every` steps, the only
    host sync of the decode loop).  `policy` is a cache policy object (`full` if None).
    compile=True runs the compiled decode step (`compiled_steps`, warmed up first); compile_prefill=True
    compiles the prefill step as well.  on_token(tokens [B]) is called as each step's tokens are sampled
    (the CLI streams with it: `stream_printer`); after a sequence's EOS its entries are padding.
    """
    if compile_prefill and not compile:
        raise UsageError("compile_prefill needs compile (--compile-prefill needs --compile)")
    if context is not None:
        if policy is not None or max_seq_length is not None or chat or compile:
            raise UsageError("with a context, the policy, max_seq_length and chat template are the context's "
                             "(prefill_context), and compile is not supported")
        return answer_questions(model, tokenizer, context, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                stop_check_every)
    policy = policy if policy is not None else FullCache()
    device = model.output.weight.device
    ids = encode_prompts(tokenizer, prompts, chat)
    lengths = [len(x) for x in ids]
    max_seq_length = check_length(max(lengths), max_new_tokens, max_seq_length, model.args.max_position_embeddings)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_ids[0]
    tokens, input_pos = left_pad(ids, pad, device)
    policy.prepare(model, tokenizer)            # calibration files it needs, made on first use
    if compile:
        prefill, decode = compiled_steps(device, compile_prefill)
        warm_up(model, prefill, decode, tokens.new_full((len(ids), warmup_length(policy)), pad), policy)
    else:
        prefill, decode = prefill_step, decode_step
    model.setup_caches(len(ids), max_seq_length, policy)
    sampler = Sampler(temperature, top_k, top_p, torch.Generator(device).manual_seed(seed) if seed is not None else None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        first = sampler(run_prefill(model, tokens, input_pos, prefill, prefill_chunk))
        sync()
        t1 = time.perf_counter()
        out, steps = decode_loop(model, first, input_pos[:, -1:] + 1, max_new_tokens, sampler,
                                 torch.tensor(tokenizer.eos_ids, device=device), pad, decode, stop_check_every,
                                 on_token=on_token)
        sync()
        t2 = time.perf_counter()
    generated = [until_eos(row, tokenizer) for row in out[:, :steps + 1].tolist()]
    stats = generation_stats(model.cache, lengths, steps, t1 - t0, t2 - t1, device, graph_report(decode))
    return GenerationResult([tokenizer.decode(g) for g in generated], generated, lengths, stats)


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF/converted model directory or .gguf file")
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch of different prompts)")
    p.add_argument("--prompt-file", action="append", help="file whose whole text is one prompt (repeatable)")
    p.add_argument("--context-file", help="compress this file's text once, without the question (the agnostic protocol), "
                                          "then answer each --prompt about it (with --chat: the text opens the user "
                                          "turn and each question follows it)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    p.add_argument("--interactive", action="store_true",
                   help="a multi-turn chat in the terminal: each line read is a user turn, answered with the "
                        "checkpoint's chat template (the whole conversation is prefilled each turn); "
                        "/reset forgets it, /exit or end of input ends")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, help="default: the number of prompts; a single prompt is repeated")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="auto: quantized checkpoints (quantize.py output; GGUF Q8_0/Q4_0/Q4_1) run from their own "
                        "int8/int4 weights; float: dequantize them to --dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile-prefill", action="store_true",
                   help="with --compile, the prefill step too (on CPU eager prefill is faster)")
    p.add_argument("--max-seq-length", type=int, help="cache length (prompt + new tokens); default: just enough")
    p.add_argument("--policy", default="full", help=f"KV-cache policy spec NAME[:key=value,...], e.g. snapkv:budget=128, "
                                                    f"snapkv:ratio=0.5 (half the prompt removed) or "
                                                    f"snapkv+hshare:preset=short; NAME one of {', '.join(policy_names())}")
    p.add_argument("--policy-args", default="", help="more policy parameters, k=v,k=v (--policy X --policy-args k=v "
                                                     "is the same as --policy X:k=v)")
    add_kv_flags(p)
    add_tp_flags(p)
    return p


def add_tp_flags(p: argparse.ArgumentParser) -> None:
    """--tp / --tp-head (the benchmark takes them too)."""
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism over N processes, sharded by KV head: "
                                                     "launch with torchrun --nproc-per-node N (tp.py)")
    p.add_argument("--tp-head", choices=tensor_parallel.HEADS, default="auto",
                   help="output head under --tp: vocab (each process its vocabulary slice, logits all-gathered), "
                        "replicated, or auto (default: vocab on CUDA, replicated on CPU)")


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """--kv-bits / --kv-dtype / --kv-group-size / --kv-residual (the evals and the benchmark take them too)."""
    p.add_argument("--kv-bits", type=int, default=16, choices=[32, 16, 4, 2],
                   help="KV storage bits: 16 = unquantized in --kv-dtype (default: the compute dtype), 32 = float32 "
                        "(full), 4 or 2 = KIVI-packed (any policy but pod; sparse readers read packed storage)")
    p.add_argument("--kv-dtype", choices=["bfloat16", "float16", "float32"],
                   help="storage dtype of the unquantized `full` cache (default: the compute dtype); attention "
                        "computes in the compute dtype")
    p.add_argument("--kv-group-size", type=int, default=GROUP, help="KIVI group G: keys per channel over G tokens, "
                                                                 "values per token over G channels (default 32)")
    p.add_argument("--kv-residual", type=int, default=RESIDUAL,
                   help=f"KIVI residual R (a multiple of G; default {RESIDUAL}): keys are quantized R at a time, "
                        f"the n mod R newest stay in full precision; values keep a FIFO of the newest R")


def kv_policy(policy, args):
    """The policy with --kv-bits/--kv-dtype/--kv-group-size/--kv-residual applied (UsageError for bad values
    or a policy without that storage).  A storage dtype equal to the compute dtype (--dtype on --device)
    is the policy as it is, so --kv-bits 32 on a float32 model changes nothing."""
    compute = resolve_dtype(args.dtype, resolve_device(args.device))
    try:
        return kv_storage(policy, args.kv_bits, args.kv_group_size, args.kv_residual, args.kv_dtype, compute)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_kv_fits(args, model_args) -> None:
    """UsageError unless the model's head_dim suits --kv-group-size (and the packing) at --kv-bits."""
    if args.kv_bits not in (32, 16):
        try:
            check_format(model_args.head_dim, args.kv_bits, args.kv_group_size, args.kv_residual)
        except ValueError as e:
            raise UsageError(str(e)) from None


def collect_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    for f in args.prompt_file or []:
        try:
            prompts.append(Path(f).read_text())
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file {f}: {e.strerror}") from e
    if not prompts:
        raise UsageError("give a prompt with --prompt or --prompt-file")
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt")
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UsageError("--batch-size must be at least 1")
        if len(prompts) == 1:
            prompts = prompts * args.batch_size
        elif len(prompts) != args.batch_size:
            raise UsageError(f"--batch-size {args.batch_size} does not match the {len(prompts)} prompts given")
    return prompts


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_cli(args)
    except (UsageError, CheckpointError, PolicyError, TPError, FileNotFoundError) as e:
        return tensor_parallel.fail(str(e))      # under --tp every process meets the same error
    finally:
        tensor_parallel.finish()


def run_cli(args: argparse.Namespace) -> int:
    """main() after parsing: generate, then print (rank 0 only under --tp).  A single sequence is printed as
    it is generated; a batch once it is done, each text after a `--- [i]` line."""
    if args.compile_prefill and not args.compile:
        raise UsageError("--compile-prefill needs --compile")
    if args.interactive and (args.prompt or args.prompt_file or args.batch_size or args.tp > 1):
        raise UsageError("--interactive reads its prompts from the terminal, one sequence in one process: "
                         "drop --prompt/--prompt-file/--batch-size/--tp")
    prompts = [] if args.interactive else collect_prompts(args)
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    Sampler(args.temperature, args.top_k, args.top_p)            # bad sampling flags fail before loading
    policy = kv_policy(make_policy(args.policy, args.policy_args), args)
    context = read_context(args)
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.checkpoint, device, args.dtype, args.weights, args.tp, args.tp_head)
    check_kv_fits(args, model.args)
    if args.interactive:
        return chat_loop(model, tokenizer, policy, args, sys.stdin, sys.stdout)
    seed = args.seed
    if seed is None and model.args.shard is not None:             # every process must sample alike
        seed = model.args.shard.shared_seed()
    streamed = context is None and len(prompts) == 1 and tensor_parallel.is_leader()
    on_token, stream = stream_printer(tokenizer, sys.stdout) if streamed else (None, None)
    if context is not None:
        result = answer_cli(args, model, tokenizer, context, prompts, seed)
    else:
        result = generate(model, tokenizer, prompts, args.max_new_tokens, args.temperature, args.top_k,
                          args.top_p, seed, policy, args.max_seq_length, args.chat, args.compile,
                          compile_prefill=args.compile_prefill, on_token=on_token)
    if not tensor_parallel.is_leader():
        return 0
    if streamed:
        print(stream.flush(), flush=True)
    for i, text in enumerate(result.texts if len(result.texts) > 1 else []):
        print(f"--- [{i}]")
        print(text)
    print(format_stats(result.stats), file=sys.stderr)
    if context is not None:
        s = result.stats
        print(f"context {s['context_tokens']} tokens prefilled once in {s['context_prefill_seconds']:.2f} s "
              f"({s['context_prefills_again']} prefilled again); {len(prompts)} questions answered in "
              f"{s['questions_seconds']:.2f} s", file=sys.stderr)
    return 0


def stream_printer(tokenizer: Tokenizer, out: TextIO) -> tuple[Callable[[torch.Tensor], None], TextStream]:
    """(on_token for generate, its TextStream): writes the first sequence's text to `out` as it is generated
    (flushed, a partial character held back), up to its EOS; `stream.flush()` is what is left to print."""
    stream, eos, ended = TextStream(tokenizer), set(tokenizer.eos_ids), []

    def on_token(tokens: torch.Tensor) -> None:
        token = int(tokens[0])
        if ended or token in eos:
            ended.append(True)
            return
        out.write(stream.push(token))
        out.flush()
    return on_token, stream


def chat_loop(model: Transformer, tokenizer: Tokenizer, policy, args, lines: TextIO, out: TextIO) -> int:
    """--interactive: each line of `lines` is a user turn; the answer (generate on the whole conversation in the
    chat template, streamed) goes to `out`, one line per answer; the prompt "> " goes to stderr.  A turn that
    does not fit the context is refused with a message and forgotten."""
    if tokenizer.chat_template is None:
        raise UsageError(f"--interactive needs a chat template; {args.checkpoint} has none")
    messages = []
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                               add_special_tokens=False)
        on_token, stream = stream_printer(tokenizer, out)
        try:
            result = generate(model, tokenizer, [ids], args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                              args.seed, policy, args.max_seq_length, compile=args.compile, on_token=on_token)
        except UsageError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print(stream.flush(), file=out, flush=True)
        messages.append({"role": "assistant", "content": result.texts[0]})


def read_context(args) -> Optional[str]:
    """--context-file's text (None without it); UsageError for flags that do not apply to it."""
    if not args.context_file:
        return None
    for flag, value in (("--batch-size", args.batch_size), ("--max-seq-length", args.max_seq_length),
                        ("--compile", args.compile or None), ("--tp", args.tp if args.tp > 1 else None)):
        if value is not None:
            raise UsageError(f"{flag} does not apply with --context-file")
    try:
        text = Path(args.context_file).read_text()
    except OSError as e:
        raise UsageError(f"cannot read --context-file {args.context_file}: {e.strerror}") from None
    if not text.strip():
        raise UsageError(f"--context-file {args.context_file} is empty")
    return text


def answer_cli(args, model: Transformer, tokenizer: Tokenizer, text: str, questions: list[str],
               seed: Optional[int]) -> GenerationResult:
    """Compress the context once (room for the longest question + --max-new-tokens), then answer each question."""
    new_policy = lambda: kv_policy(make_policy(args.policy, args.policy_args), args)   # noqa: E731
    suffix = chat_pieces(tokenizer, SENTINEL)[1] if args.chat else []
    longest = max(len(tokenizer.encode(q, add_special_tokens=False)) for q in questions) + len(suffix)
    ctx = prefill_context(model, tokenizer, text, new_policy, longest + args.max_new_tokens, args.chat)
    return generate(model, tokenizer, questions, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    seed, context=ctx)


if __name__ == "__main__":
    sys.exit(main())
