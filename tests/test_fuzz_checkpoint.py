"""Seeded fuzzing of the checkpoint readers (scripts/fuzz_checkpoint.py): corrupt copies of the real
default GGUF and of the converted safetensors directory either validate or raise CheckpointError, each
within seconds; through engine.py a corrupt file gives one `error: <file>: ...` line and exit 2."""
import random
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import fuzz_checkpoint  # noqa: E402

CASE_LIMIT = 10.0   # seconds; a hang or a huge allocation shows up here


@pytest.mark.parametrize("target, cases, seed", [("gguf", 120, 24), ("dir", 160, 24)])
def test_fuzzed_checkpoints_fail_cleanly(target, cases, seed, default_gguf, default_dir, tmp_path):
    make = {"gguf": lambda: fuzz_checkpoint.GGUFTarget(default_gguf, tmp_path),
            "dir": lambda: fuzz_checkpoint.DirTarget(default_dir, tmp_path)}[target]
    r = fuzz_checkpoint.fuzz(make(), cases, seed, CASE_LIMIT)
    assert not r["failures"], r["failures"][:5]
    assert r["error"] > cases // 2      # the mutations really break things...
    assert r["ok"] + r["error"] == cases


def test_fuzz_restores_the_copy(default_gguf, default_dir, tmp_path):
    """Each case undoes its mutation: after a run the working copies still validate."""
    for target in (fuzz_checkpoint.GGUFTarget(default_gguf, tmp_path), fuzz_checkpoint.DirTarget(default_dir, tmp_path)):
        fuzz_checkpoint.fuzz(target, 5, 1)
        assert fuzz_checkpoint.run_case(target.path) == "ok"


@pytest.mark.parametrize("target, kind", [("gguf", "truncate"), ("dir", "shape lies")])
def test_cli_corrupt_checkpoint_exit_2(target, kind, default_gguf, default_dir, tmp_path):
    t = fuzz_checkpoint.GGUFTarget(default_gguf, tmp_path) if target == "gguf" else \
        fuzz_checkpoint.DirTarget(default_dir, tmp_path)
    rng = random.Random(0)
    while True:                                    # the first seeded case of the wanted kind
        label, apply, undo = t.case(rng)
        if label.startswith(kind):
            break
    apply()
    r = subprocess.run([sys.executable, str(ROOT / "engine.py"), "--checkpoint", str(t.path), "--prompt", "hi",
                        "--max-new-tokens", "1", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: {t.path}") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
