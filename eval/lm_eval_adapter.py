"""This engine with a KV-cache policy as an lm-evaluation-harness model, registered as `kvpolicy`.

    python -m eval.lm_eval_adapter --model_args checkpoint=checkpoints/SmolLM2-135M-Instruct,policy=snapkv:budget=64 \
        --tasks TASK --include_path DIR

The command is lm-eval's own CLI (`lm-eval run`, every flag of it) with `--model kvpolicy` filled in: the stock
`lm_eval` command cannot name this model, as the harness discovers no models outside its package.  From Python,
`import eval.lm_eval_adapter` registers it: `lm_eval.simple_evaluate(model="kvpolicy", model_args=...)`.
Needs the `lmeval` extra (`pip install -e '.[lmeval]'`).

model_args (MODEL_ARGS): checkpoint (required), policy (a spec, cache/spec.py; quote one with several arguments:
`policy="snapkv:budget=64,obs_window=16"`), kv_bits / kv_dtype / kv_group_size / kv_residual (the evals' --kv-*
flags), device, dtype, max_length, batch_size (1 only: requests run one at a time).

Protocol.  Every request gets a fresh policy.  The text the harness calls the context is prefilled with the
policy active, so a compressing policy compresses it alone; whatever follows goes through decode steps, so
decode-time eviction keeps acting:
- loglikelihood(context, continuation): the context compressed without the continuation, then the
  continuation's tokens teacher-forced one decode step each (`measure.forced_logits`; docs/design.md calls
  this the agnostic protocol); the score is the sum of their log-softmax.  A context longer than max_length
  loses its left end, as in the harness's HF model.
- loglikelihood_rolling(text): the harness's disjoint windows of max_length tokens (each token predicted once,
  the first window after the prefix token); each window is a loglikelihood request whose context is its first
  token, so only decode-time eviction (streaming, h2o, tova, ...) changes a window's score, while a policy that
  compresses only its prompt (snapkv, pyramidkv) scores as the full cache.
- generate_until(context, gen_kwargs): engine.generate on the context (compressed whole), up to max_gen_toks
  tokens or EOS, the text cut before the first of the `until` strings (generation is not stopped early).
"""
from __future__ import annotations

import importlib.util
import sys

if __name__ == "__main__":
    if importlib.util.find_spec("lm_eval") is None:
        sys.exit("error: lm-evaluation-harness is not installed: pip install -e '.[lmeval]'")

from dataclasses import dataclass, fields  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval._cli.utils import key_val_to_dict  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

import engine  # noqa: E402
from cache import PolicyError, make_policy  # noqa: E402
from cache.quantized import GROUP, RESIDUAL  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from eval import measure  # noqa: E402
from eval.common import UsageError  # noqa: E402

MODEL_NAME = "kvpolicy"


@dataclass
class Settings:
    """The model_args, typed (attribute names as the evals' flags, so engine.kv_policy reads them)."""
    checkpoint: str
    policy: str = "full"
    kv_bits: int = 16
    kv_dtype: Optional[str] = None
    kv_group_size: int = GROUP
    kv_residual: int = RESIDUAL
    device: Optional[str] = None
    dtype: Optional[str] = None
    max_length: Optional[int] = None        # None: the model's context length - 1
    batch_size: int = 1


MODEL_ARGS = tuple(f.name for f in fields(Settings))
INTS = ("kv_bits", "kv_group_size", "kv_residual", "max_length", "batch_size")


def parse_settings(given: dict) -> Settings:
    """model_args (strings or values) -> Settings; UsageError naming a bad key or value."""
    unknown = sorted(set(given) - set(MODEL_ARGS))
    if unknown:
        hint = ("; a policy spec with several arguments must be quoted: policy=\"snapkv:budget=64,obs_window=16\""
                if "policy" in given else "")
        raise UsageError(f"unknown model_args key(s) {', '.join(unknown)} for {MODEL_NAME}; "
                         f"keys: {', '.join(MODEL_ARGS)}{hint}")
    if "checkpoint" not in given:
        raise UsageError(f"{MODEL_NAME} needs model_args checkpoint=DIR|FILE.gguf")
    values = {k: None if v is None else str(v) for k, v in given.items()}
    for key in INTS:
        if values.get(key) is not None:
            try:
                values[key] = int(values[key])
            except ValueError:
                raise UsageError(f"model_args {key}={given[key]!r} is not an integer") from None
    settings = Settings(**values)
    if settings.batch_size != 1:
        raise UsageError(f"{MODEL_NAME} runs one request at a time: batch_size must be 1, got {settings.batch_size}")
    if settings.max_length is not None and settings.max_length < 2:
        raise UsageError(f"model_args max_length must be at least 2, got {settings.max_length}")
    return settings


def harness_config(model_args: dict, config: dict) -> dict:
    """The harness's own settings that reach the model (batch_size, device; max_batch_size has no use here),
    each unless model_args name it.  Its CLI always sends a device (default cuda:0): as the harness's HF model
    does, one naming CUDA where none is available is dropped (the engine's default then: cpu)."""
    out = {k: v for k, v in config.items() if v is not None and k not in model_args and k != "max_batch_size"}
    if str(out.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
        del out["device"]
    return out


def new_policy(settings: Settings):
    """A fresh policy of settings.policy with its KV storage (PolicyError/UsageError for bad input)."""
    return engine.kv_policy(make_policy(settings.policy), settings)


GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed")


@register_model(MODEL_NAME)
class KVPolicyLM(TemplateLM):
    """The harness's model: engine.load_model's model with a fresh `policy` per request (module doc)."""

    def __init__(self, **model_args):
        super().__init__()
        self.settings = parse_settings(model_args)
        new_policy(self.settings)                   # a bad spec or storage fails before the model loads
        self.model, self.tokenizer = engine.load_model(self.settings.checkpoint, self.settings.device,
                                                       self.settings.dtype)
        engine.check_kv_fits(self.settings, self.model.args)
        window = self.model.args.max_position_embeddings
        self.max_length = self.settings.max_length or window - 1   # + 1: forced_logits' spare slot
        if self.max_length >= window:
            raise UsageError(f"model_args max_length {self.max_length} must be below the model's context "
                             f"length {window}")
        self._device = self.model.output.weight.device
        self.new_policy().prepare(self.model, self.tokenizer)     # calibration files, made once

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "KVPolicyLM":
        """'k=v,k2="a,b"': split like the lm-eval CLI's --model_args (quotes keep commas), not at every comma."""
        try:
            args = key_val_to_dict(arg_string or "")
        except ValueError as e:
            raise UsageError(f"model_args {arg_string!r}: {e}") from None
        return cls.create_from_arg_obj(args, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "KVPolicyLM":
        return cls(**arg_dict, **harness_config(arg_dict, additional_config or {}))

    def new_policy(self):
        return new_policy(self.settings)

    # ----------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on: BOS, else EOS (as HF's model)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """Token ids of `string`; BOS as the checkpoint's tokenizer adds it unless add_special_tokens says."""
        return self.tokenizer.encode(string, add_special_tokens=True if add_special_tokens is None
                                     else add_special_tokens)

    @property
    def tokenizer_name(self) -> str:
        return str(self.settings.checkpoint)

    def chat_template(self, chat_template=False) -> Optional[str]:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ----------------------------------------------------------------- scoring
    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding gives it): the context prefilled with
        a fresh policy, the continuation teacher-forced through decode steps; the context's left end is cut so
        that at most max_length tokens go in."""
        if not continuation:
            raise UsageError("an empty continuation has nothing to score")
        if len(continuation) > self.max_length:
            raise UsageError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
        tokens = (context + continuation)[-(self.max_length + 1):]
        logits = measure.forced_logits(self.model, torch.tensor(tokens), len(tokens) - len(continuation),
                                       self.new_policy())                             # [E, V] float32
        target = torch.tensor(continuation, device=logits.device)
        logprobs = F.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]   # [E]
        return logprobs.double().sum().item(), bool((logits.argmax(-1) == target).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [((context, continuation) text, context ids, continuation ids)] (TemplateLM.loglikelihood)."""
        out = []
        for key, context, continuation in requests:
            out.append(self.score(context, continuation))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over each text's tokens, in the harness's disjoint windows of max_length (module doc)."""
        out = []
        for (text,) in [r.args for r in requests]:
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(self.score(context, continuation)[0] for context, continuation in windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
        return out

    # ----------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            out.append(self.generate_one(context, dict(gen_kwargs)))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out[-1])
        return out

    def generate_one(self, context: str, gen_kwargs: dict) -> str:
        """engine.generate on the context (its left end cut to leave max_gen_toks), cut before the first `until`."""
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise UsageError(f"{MODEL_NAME} does not take gen_kwargs {', '.join(unknown)}; it takes {', '.join(GEN_KWARGS)}")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen_toks = int(gen_kwargs.get("max_gen_toks", 256))
        if not 0 < max_gen_toks < self.max_length:
            raise UsageError(f"max_gen_toks {max_gen_toks} must lie in [1, max_length {self.max_length})")
        sampled = bool(gen_kwargs.get("do_sample", False))
        temperature = float(gen_kwargs.get("temperature", 1.0 if sampled else 0.0)) if sampled else 0.0
        ids = self.tok_encode(context)[-(self.max_length - max_gen_toks):]
        result = engine.generate(self.model, self.tokenizer, [ids], max_gen_toks, temperature=temperature,
                                 top_k=gen_kwargs.get("top_k"), top_p=gen_kwargs.get("top_p"),
                                 seed=gen_kwargs.get("seed"), policy=self.new_policy())
        return cut_at_stop(result.texts[0], until)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """`text` up to (excluding) the earliest occurrence of any of the `until` strings."""
    return text[:min([i for i in (text.find(s) for s in until if s) if i >= 0], default=len(text))]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """lm-eval's CLI (`lm-eval run ARGV`) with --model kvpolicy; bad model_args -> one-line error, exit 2.
    The harness's CLI reads sys.argv itself, so ARGV is put there for the call."""
    from lm_eval.__main__ import HarnessCLI, setup_logging
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model" in argv or any(a.startswith("--model=") for a in argv):
        print(f"error: this command runs the harness with --model {MODEL_NAME}; leave --model out", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = ["lm-eval", "run", "--model", MODEL_NAME, *argv]
    try:
        setup_logging()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except (UsageError, CheckpointError, PolicyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
