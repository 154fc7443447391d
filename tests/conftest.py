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
DATA = ROOT / "data"
ESSAYS = DATA / "paul_graham_essays"
MULTI_NEWS = DATA / "longbench" / "multi_news.jsonl"


MODEL_FIXTURES = {"default_gguf", "default_dir", "engine_gguf", "engine_dir", "hf_gguf"}


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on two cores) each worker, and every process
    it starts, uses one thread: two workers with two threads each would fight over the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_sessionstart(session):
    """Say so when the C++ kernels are not built yet: the first test that uses them builds them, minutes
    during which the output is silent (the build's own line is captured with the test's stderr)."""
    if os.environ.get("KVC_CPU_KERNELS", "1") == "0" or hasattr(session.config, "workerinput"):
        return
    from kernels import cpu
    try:
        name = cpu.extension_name()
    except OSError:                         # a source missing: the build warns and the twins run
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and cpu.build_needed(name):
        reporter.write_line(
            f"kvc: the C++ kernels are not built for this machine yet: the first test that uses them builds them "
            f"(about {cpu.BUILD_MINUTES} minutes on 2 cores, cached in {cpu.build_dir(name)})")


def pytest_addoption(parser):
    parser.addoption("--durations-file", metavar="PATH", default=None,
                     help="write each test file's total duration there, slowest first (make test: "
                          "runs/test-durations.txt)")


_file_seconds: dict = {}        # test file -> [seconds (setup + call + teardown), tests]


def pytest_runtest_logreport(report):
    """Sum each test's phases per file (under xdist the controller gets every worker's reports)."""
    entry = _file_seconds.setdefault(report.nodeid.split("::")[0], [0.0, 0])
    entry[0] += report.duration
    entry[1] += report.when == "setup"


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--durations-file", None)
    if path and not hasattr(session.config, "workerinput"):        # the controller, or a run without xdist
        from atomic_io import write_text
        write_text(Path(path), durations_text(_file_seconds, int(exitstatus)))


def durations_text(files: dict, exitstatus: int) -> str:
    """{file: [seconds, tests]} -> the durations file: a header, then one line per file, slowest first."""
    rows = sorted(files.items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in files.values())
    lines = [f"# seconds per test file (setup + call + teardown of its tests, summed over workers), slowest "
             f"first; {total:.0f} s over {len(rows)} files, exit status {exitstatus}"]
    lines += [f"{s:9.1f} s {n:5d} tests  {name}" for name, (s, n) in rows]
    return "\n".join(lines) + "\n"


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


# A tiny random Llama checkpoint with the default model's tokenizer, for the tests of mechanics
# (benchmark rows, byte accounting, sweeps, interrupts, eval plumbing) that do not need the real
# model's numbers: same format, tokenizer, chat template, vocabulary, head_dim, GQA and context
# length as the default model, ~20x less compute and weight traffic per token.
TINY_CONFIG = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "intermediate_size": 256}
MODEL_FIXTURES.add("tiny_dir")  # it copies the default model's tokenizer files (so needs checkpoints/)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A HuggingFace-style directory (config.json, model.safetensors, the default model's
    tokenizer.json and tokenizer_config.json): the default model's config.json with the sizes of
    TINY_CONFIG and random weights (seed 0).  Calibration files (heavy_channels.json,
    pod_calibration.json) are made in it on first use, as for any checkpoint."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def write_tiny_checkpoint(out: Path, **sizes) -> Path:
    """Write tiny_dir's checkpoint into the new directory `out`, with config.json fields `sizes`
    overriding TINY_CONFIG's (scripts/random_checkpoint.py)."""
    from scripts.random_checkpoint import write_random_checkpoint
    _require(DEFAULT_DIR / "tokenizer.json")
    return write_random_checkpoint(_require(DEFAULT_DIR / "config.json").parent, out, **{**TINY_CONFIG, **sizes})
