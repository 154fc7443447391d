"""The wheel ships what the installed product reads: pyproject's package-data covers every C++ source
kernels/cpu.py builds (a missing source warns, the twins run), and a wheel built from the tracked files
holds every module of the packages and py-modules pyproject names, the kernel sources and the data
files the code reads beside itself."""
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest

from cache import calibration
from eval import common, longbench
from kernels import cpu
from tests.test_self_contained import tracked_files

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_dir(package: str) -> Path:
    return ROOT.joinpath(*package.split("."))


def files_read_at_run_time() -> list[Path]:
    """What the code opens beside itself: the kernel sources, LongBench's templates, the calibration
    text and the evals' bundled data."""
    folders = [calibration.CALIBRATION_TEXT, common.ESSAYS, longbench.DATA_DIR]
    return cpu.SOURCES + cpu.HEADERS + [longbench.TASKS_FILE] + [p for f in folders for p in sorted(f.iterdir())]


def expected_wheel_files() -> set[str]:
    """Paths (relative to the repository root) the wheel must hold: every py-module, every tracked .py
    under a listed package (a sub-package missing from `packages` is caught), every package-data match."""
    tracked = [p.relative_to(ROOT) for p in tracked_files(ROOT) if p.is_file() and not p.is_symlink()]
    want = {f"{m}.py" for m in SETUPTOOLS.get("py-modules", [])}
    for package in SETUPTOOLS["packages"]:
        inside = [p for p in tracked if p.is_relative_to(package_dir(package).relative_to(ROOT))]
        want |= {p.as_posix() for p in inside if p.suffix == ".py"}
        for pattern in SETUPTOOLS.get("package-data", {}).get(package, []):
            hits = {p.as_posix() for p in inside if len(p.parts) == package.count(".") + 2 and fnmatch(p.name, pattern)}
            assert hits, f"package-data pattern {pattern!r} of {package} matches no tracked file"
            want |= hits
    return want


def test_package_data_ships_every_kernel_source_and_header():
    patterns = SETUPTOOLS["package-data"]["kernels"]
    for path in cpu.SOURCES + cpu.HEADERS:
        assert path.is_file(), path
        assert any(fnmatch(path.name, p) for p in patterns), f"{path.name} is not in kernels' package-data"


def test_the_build_tag_covers_every_include():
    included = {name for p in cpu.SOURCES + cpu.HEADERS for name in re.findall(r'#include "([^"]+)"', p.read_text())}
    assert included and included <= {p.name for p in cpu.HEADERS}


def test_a_missing_source_warns_and_leaves_the_twins(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "SOURCES", cpu.SOURCES + [tmp_path / "missing.cpp"])
    with pytest.warns(RuntimeWarning, match="could not be built.*missing.cpp"):
        assert cpu._build() is False


def test_the_wheel_holds_every_runtime_file(tmp_path):
    """Builds the wheel from a copy of the tracked files (the checkout stays clean; ~2 s)."""
    src = tmp_path / "src"
    for path in tracked_files(ROOT):
        if path.is_file() and not path.is_symlink():
            (src / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / path.relative_to(ROOT))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Warning" not in out.stderr, out.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = expected_wheel_files() | {p.relative_to(ROOT).as_posix() for p in files_read_at_run_time()}
    assert sorted(want - names) == []
