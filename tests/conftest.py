"""Shared fixtures: the default real model (fetched by `make test`) and small helpers."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECKPOINTS = ROOT / "checkpoints"
DEFAULT_DIR = CHECKPOINTS / "SmolLM2-135M-Instruct"
DEFAULT_GGUF = CHECKPOINTS / "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = ROOT / "data"
ESSAYS = DATA / "paul_graham_essays"
MULTI_NEWS = DATA / "longbench" / "multi_news.jsonl"


MODEL_FIXTURES = {"default_gguf", "default_dir", "engine_gguf", "engine_dir", "hf_gguf"}


def pytest_collection_modifyitems(items):
    """Every test that loads the real default model carries the `model` marker (deselect with
    -m "not model"): the ones that use a model fixture get it here, so the marker cannot go stale.
    Tests marked `gpu` run where torch sees a CUDA device and are skipped elsewhere."""
    import torch
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)


def _require(path: Path) -> Path:
    if not path.exists():   # fail, never skip: a green run must have run the real-model tests
        pytest.fail(f"{path} missing: run `python scripts/fetch_default_model.py` (make test does), "
                    f"or deselect the real-model tests with -m 'not model'")
    return path


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return _require(DEFAULT_GGUF)


@pytest.fixture(scope="session")
def default_dir() -> Path:
    return _require(DEFAULT_DIR / "config.json").parent


@pytest.fixture(scope="session")
def essay_text() -> str:
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
