"""kvpress's side of the suite's peer comparison, run in kvpress's own environment (eval/kvpress_peer.py).

    python -m eval.kvpress_child JOB.json

Imports only the standard library, torch, transformers and kvpress (never this project's engine), so
it runs under the interpreter of a venv that holds kvpress and the transformers it pins.  JOB.json:
{"checkpoint": HF folder, "dtype": "float32", "device": "cpu" or "cuda", "threads": N, "requests": [{"context": ids,
"question": ids, "max_new_tokens": n}], "jobs": [{"method", "press" (a kvpress class name, or
null for no press), "ratio"}]}.  Prints one JSON line per job, {"method", "ratio", "seconds",
"answers"} (or "error": a press that raises fails alone), as each finishes.  Each answer comes from KVPressTextGenerationPipeline._forward (through
Pipeline.forward): the context prefilled once with the press active, then the question appended
whole and answered greedily, stopping at the model's EOS.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

EAGER = {"ObservedAttentionPress"}        # presses that read the attention weights need eager attention


def make_press(name: Optional[str], ratio: float):
    """kvpress's press `name` at compression_ratio `ratio` with its defaults (None: no press)."""
    if name is None:
        return None
    import kvpress
    return getattr(kvpress, name)(compression_ratio=ratio)


def load_pipeline(checkpoint: str, dtype: str, attn: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    import kvpress  # noqa: F401 - registers the kv-press-text-generation pipeline
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype), attn_implementation=attn)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=device)


def serve(job_path: str) -> int:
    """Answer the job's requests with every press it lists; one JSON line per press on stdout."""
    import torch
    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    pipes: dict = {}
    for j in job["jobs"]:
        attn = "eager" if j["press"] in EAGER else "sdpa"
        if attn not in pipes:
            pipes[attn] = load_pipeline(job["checkpoint"], job["dtype"], attn, job.get("device", "cpu"))
        t0 = time.perf_counter()
        try:
            answers = answer_all(pipes[attn], make_press(j["press"], j["ratio"]), job["requests"])
        except Exception as e:     # noqa: BLE001 - a press that fails is that press's row, the others go on
            done = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        else:
            done = {"answers": answers}
        seconds = time.perf_counter() - t0
        print(f"  kvpress {j['method']} ratio {j['ratio']:g}: {done.get('error') or 'ok'} ({seconds:.1f} s)",
              file=sys.stderr, flush=True)
        print(json.dumps({"method": j["method"], "ratio": j["ratio"], "seconds": seconds, **done}), flush=True)
    return 0


def answer_all(pipe, press, requests: list[dict]) -> list[str]:
    """The pipeline's answer to each request: its context prefilled under `press`, its question appended."""
    import torch
    answers = []
    for r in requests:
        inputs = {"context_ids": torch.tensor([r["context"]]), "questions_ids": [torch.tensor([r["question"]])]}
        answers += pipe.forward(inputs, press=press, max_new_tokens=r["max_new_tokens"])
    return answers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="kvpress's side of python -m eval.suite --peers kvpress (it runs this)")
    p.add_argument("job", help="the job file (this module's docstring)")
    return serve(p.parse_args(argv).job)


if __name__ == "__main__":
    sys.exit(main())
