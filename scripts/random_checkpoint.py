"""A checkpoint directory with another one's config.json and tokenizer files but random weights (seed 0):
for speed runs, where the weights' values do not matter (a decode step costs the same), on a machine
that has the config but not the weights (a GPU machine reached without the network, say).

    python scripts/random_checkpoint.py --like checkpoints/SmolLM2-135M-Instruct --out /tmp/random-smollm2 \\
        [--set num_hidden_layers=3 --set hidden_size=128 ...]

--set overrides config.json fields (sizes).  With no --set the model has the same shapes, so its
calibration files (heavy_channels.json, pod_calibration.json) are copied too; with --set they are made
on first use, as for any checkpoint.  Weights: HuggingFace Llama names (lm_head.weight unless the config ties it
to the embedding), 0.02 * N(0, 1) (HF's initializer_range) and norms 1 + 0.1 * N(0, 1), in --dtype, drawn on
--device.  --like may be a directory with a config.json only (data/configs/: configurations of models whose
weights are not here) when --tokenizer names one with tokenizer files:

    python scripts/random_checkpoint.py --like data/configs/llama-3.1-8b --tokenizer checkpoints/SmolLM2-135M-Instruct \
        --dtype bfloat16 --device cuda --out /tmp/random-llama-3.1-8b

The tests' tiny model (tests/conftest.py) is written by this function.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

CALIBRATION = ("heavy_channels.json", "pod_calibration.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES = ("bfloat16", "float32")        # the weights' dtype, by torch's name


def write_random_checkpoint(like: Path, out: Path, tokenizer: Optional[Path] = None, dtype: str = "float32",
                            device: str = "cpu", **sizes) -> Path:
    """Write the new directory `out`: like/config.json with `sizes` overriding its fields, the tokenizer files of
    `tokenizer` (default: like), random weights in `dtype` drawn on `device` (module docstring); like's
    calibration files when sizes is empty."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config = {**json.loads((like / "config.json").read_text()), **sizes}
    dim, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or dim // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], dim), "model.norm.weight": (dim,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], dim)
    for i in range(config["num_hidden_layers"]):   # HF Llama names
        shapes.update({f"model.layers.{i}.{k}": s for k, s in {
            "self_attn.q_proj.weight": (q, dim), "self_attn.k_proj.weight": (kv, dim),
            "self_attn.v_proj.weight": (kv, dim), "self_attn.o_proj.weight": (dim, q),
            "mlp.gate_proj.weight": (inter, dim), "mlp.up_proj.weight": (inter, dim),
            "mlp.down_proj.weight": (dim, inter),
            "input_layernorm.weight": (dim,), "post_attention_layernorm.weight": (dim,)}.items()})
    g = torch.Generator(device).manual_seed(0)
    tensors = {name: ((1 + 0.1 * torch.randn(s, generator=g, device=device)) if name.endswith("norm.weight")  # norms
                      else 0.02 * torch.randn(s, generator=g, device=device)).to(getattr(torch, dtype)).cpu()
               for name, s in shapes.items()}   # 0.02: HF's initializer_range
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy((tokenizer or like) / name, out / name)
    for name in () if sizes else CALIBRATION:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", type=Path, required=True, help="a checkpoint directory (config.json, tokenizer files)")
    p.add_argument("--out", type=Path, required=True, help="the new directory (must not exist)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=INT", help="override a config.json size")
    p.add_argument("--tokenizer", type=Path, help="copy the tokenizer files from this directory (default: --like)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the weights' dtype (default float32)")
    p.add_argument("--device", default="cpu", help="draw the weights there (cuda: seconds for an 8B model)")
    a = p.parse_args(argv)
    sizes = {}
    for item in a.set:
        field, _, value = item.partition("=")
        if not value.isdigit():
            p.error(f"--set {item!r}: expected FIELD=INT")
        sizes[field] = int(value)
    if not (a.like / "config.json").is_file():
        p.error(f"--like {a.like}: no config.json there")
    for name in TOKENIZER_FILES:
        if not ((a.tokenizer or a.like) / name).is_file():
            p.error(f"--{'tokenizer' if a.tokenizer else 'like'} {a.tokenizer or a.like}: no {name} there")
    if a.out.exists():
        p.error(f"--out {a.out} exists")
    out = write_random_checkpoint(a.like, a.out, a.tokenizer, a.dtype, a.device, **sizes)
    print(f"wrote {out} (random weights, the config of {a.like}{', ' + ', '.join(a.set) if a.set else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
