"""Shared fixtures: the default real model (fetched by `make test`) and small helpers."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECKPOINTS = ROOT / "checkpoints"
DEFAULT_DIR = CHECKPOINTS / "SmolLM2-135M-Instruct"
DEFAULT_GGUF = CHECKPOINTS / "SmolLM2-135M-Instruct.Q4_1.gguf"
ESSAYS = ROOT.parent / "shared" / "data" / "paul_graham_essays"


def _require(path: Path) -> Path:
    if not path.exists():
        msg = f"{path} missing: run `python scripts/fetch_default_model.py` (make test does)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI must run the real-model tests, never skip them
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return _require(DEFAULT_GGUF)


@pytest.fixture(scope="session")
def default_dir() -> Path:
    return _require(DEFAULT_DIR / "config.json").parent


@pytest.fixture(scope="session")
def essay_text() -> str:
    if not ESSAYS.is_dir():
        pytest.skip(f"{ESSAYS} missing (../shared/data is not beside the checkout)")
    return "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt"))[:6])


@pytest.fixture(scope="session")
def engine_gguf(default_gguf):
    """The GGUF dequantized to float32 (what transformers loads from it, the oracle's weights)."""
    import engine
    return engine.load_model(default_gguf, weights="float")


@pytest.fixture(scope="session")
def engine_dir(default_dir):
    import engine
    return engine.load_model(default_dir)


@pytest.fixture(scope="session")
def hf_gguf(default_gguf):
    import torch
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                            dtype=torch.float32).eval()
