"""What every mode shares: the loaded model, the options, the row writer, the memory meter and the
roofline inputs, plus the common row fields and the handling of rows that cannot be measured."""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence, TypeVar

import torch

from bench.measure import MemoryMeter, device_name, release
from bench.report import RowWriter, print_failure
from bench.roofline import unique_weight_bytes
from bench.specs import Config, build_policy, context_problem, grid, make_prompt, skip_reason

T = TypeVar("T")


class Bench:
    """The state of one benchmark run.  A mode (bench/modes.py) reads the options, measures, and
    hands each finished row to `writer.add`; `errors` counts rows that failed (exit status 1)."""

    def __init__(self, model, opts, writer: RowWriter, meter: MemoryMeter, bandwidth_gbs: Optional[float],
                 file_ids: Optional[list[int]]):
        self.model, self.opts, self.writer, self.meter = model, opts, writer, meter
        self.device = model.output.weight.device
        self.dtype = model.norm.weight.dtype          # the compute dtype (linear layers may be quantized)
        self.bandwidth_gbs = bandwidth_gbs
        self.weight_bytes = unique_weight_bytes(model)
        self.file_ids = file_ids
        self.errors = 0

    def prepare(self, tokenizer) -> None:
        """Make the calibration files the configured policies need (once per checkpoint)."""
        for cfg in self.configs():
            if skip_reason(cfg) is None:
                build_policy(cfg).prepare(self.model, tokenizer)

    def configs(self) -> list[Config]:
        return grid(self.opts)

    def prompt(self, batch: int, length: int) -> torch.Tensor:
        """The run's prompt token ids [batch, length] (random or --prompt-file, see make_prompt)."""
        return make_prompt(self.model.args.vocab_size, batch, length, self.opts.seed, self.device, self.file_ids)

    def base_row(self, mode: str, cfg: Config, batch: Optional[int], context: int) -> dict:
        """The fields every row has: what was measured, and on what."""
        o = self.opts
        compile_mode = None if not cfg.compile else "inductor"
        return {"mode": mode, "policy": cfg.policy, "policy_args": cfg.policy_args, "batch_size": batch,
                "context_length": context, "kv_bits": cfg.kv_bits, "kv_dtype": cfg.row_kv_dtype,
                "decode_steps": o.decode_steps,
                "warmup_steps": o.warmup_steps, "repeats": o.repeats,
                "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "torch_version": torch.__version__, "compile": cfg.compile, "compile_mode": compile_mode,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "num_threads": torch.get_num_threads(),
                "cpu": device_name(self.device), "prompt": str(o.prompt_file) if o.prompt_file else "random",
                "tp": o.tp, "tp_head": o.tp_head if o.tp > 1 else None}

    def fail_row(self, row: dict, status: str, reason: str, keys: Sequence[str]) -> dict:
        """`row` marked "skipped" or "error" with its reason and null `keys` (the mode's measurements)."""
        for k in keys:
            row.setdefault(k, None)
        row.update(status=status, error=reason)
        print_failure(row)
        if status == "error":
            self.errors += 1
        return row

    def cannot_run(self, cfg: Config, context: int, extra: int) -> Optional[tuple[str, str]]:
        """(status, reason) when cfg cannot run at `context` + `extra` decode slots: "skipped" for a
        storage this build lacks, "error" for a context beyond the model's; None when it can."""
        reason = skip_reason(cfg)
        if reason:
            return "skipped", reason
        reason = context_problem(self.model.args.max_position_embeddings, context, extra)
        return ("error", reason) if reason else None

    def attempt(self, fn: Callable[[], T]) -> tuple[Optional[T], Optional[str]]:
        """(fn(), None), or (None, 'Type: message') when fn raised: a failing policy never ends the
        run (the model's cache is released); KeyboardInterrupt still does."""
        try:
            return fn(), None
        except Exception as e:
            release(self.model)
            return None, f"{type(e).__name__}: {e}"
