"""Convert a .gguf file or a HuggingFace directory into the engine's checkpoint directory.

    python scripts/convert_checkpoint.py model.gguf checkpoints/my-model

The output is a HuggingFace-format directory (config.json, model.safetensors in float32 with
HF tensor names and rotate-half q/k layout, tokenizer.json + tokenizer_config.json), loadable by
`engine.load_model` with memory-mapped weights and by `transformers` alike.  It is written under a
temporary name and renamed into place when complete: Ctrl-C or SIGTERM leaves `out` as it was.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atomic_io import exit_on_sigterm  # noqa: E402
from checkpoint import CheckpointError, read_checkpoint, write_converted_dir  # noqa: E402


def convert(source: Path, out: Path) -> None:
    args, tensors, tokenizer = read_checkpoint(source)
    write_converted_dir(out, args, {k: v.float() for k, v in tensors.items()}, tokenizer)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help=".gguf file or HuggingFace model directory")
    p.add_argument("out", type=Path, help="output directory")
    a = p.parse_args(argv)
    exit_on_sigterm()
    try:
        convert(a.source, a.out)
    except (CheckpointError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {a.out} left as it was", file=sys.stderr)
        return 130
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
