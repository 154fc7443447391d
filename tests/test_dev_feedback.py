"""What a developer sees: the one line before the C++ kernels' first build (kernels/cpu.py), every
environment variable the code reads listed in docs/usage.md, and `make test`'s per-file durations."""
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

import kernels.cpu as cpu


def test_a_build_is_needed_when_the_library_is_missing_or_older_than_a_source(tmp_path):
    sources = [tmp_path / "a.cpp", tmp_path / "b.h"]
    for p in sources:
        p.write_text("x")
    library = tmp_path / "kvc.so"
    assert cpu.needs_build(library, sources)                       # never built
    library.write_text("built")
    now = time.time()
    for p in sources:
        os.utime(p, (now - 60, now - 60))
    os.utime(library, (now, now))
    assert not cpu.needs_build(library, sources)                   # cached: load only, nothing printed
    os.utime(sources[1], (now + 60, now + 60))
    assert cpu.needs_build(library, sources)                       # a header edited after the build


def test_the_build_dir_is_torchs(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu.build_dir("kvc_x") == Path(_get_build_directory("kvc_x", verbose=False))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))                      # torch makes the folder: keep it in tmp_path
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cpu.build_dir("kvc_x") == Path(_get_build_directory("kvc_x", verbose=False))


def test_the_build_message_is_one_line_with_the_time_and_the_way_out(tmp_path):
    line = cpu.build_message(tmp_path / "kvc_x")
    assert "\n" not in line and line.startswith("kvc: building the C++ kernels")
    assert f"about {cpu.BUILD_MINUTES} minutes" in line and str(tmp_path / "kvc_x") in line
    assert "KVC_CPU_KERNELS=0" in line


# --------------------------------------------------------------------------- environment variables

READS = [r"environ(?:\.get|\.setdefault|\.pop)?\(\s*[\"']([A-Z][A-Z0-9_]+)[\"']",     # os.environ.get("X" ...)
         r"environ\[\s*[\"']([A-Z][A-Z0-9_]+)[\"']\s*\]",                               # os.environ["X"]
         r"getenv\(\s*[\"']([A-Z][A-Z0-9_]+)[\"']",                                     # os.getenv("X")
         r"[\"']((?:KVC|KVPOLICY)_[A-Z0-9_]+)[\"']"]                # the project's own, wherever named (arith_request)


def code_files() -> list[Path]:
    """Every Python file of the repository (tests included: they read some too), the Makefile, .ci/run."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in tracked if (f.endswith(".py") or f in ("Makefile", ".ci/run")) and (ROOT / f).exists()]


def variables_read() -> dict[str, str]:
    """{name: the first file that reads it}: Python's environ/getenv calls, the KVC_/KVPOLICY_ names, and
    the Makefile's `NAME ?=` (make takes them from the environment)."""
    found = {}
    for path in code_files():
        text = path.read_text(errors="replace")
        names = [n for pattern in READS for n in re.findall(pattern, text)]
        if path.name == "Makefile":
            names += re.findall(r"^([A-Z][A-Z0-9_]*)\s*\?=", text, re.M)
        for n in names:
            found.setdefault(n, str(path.relative_to(ROOT)))
    return found


def documented() -> set[str]:
    """The names in the first column of docs/usage.md's section "Environment variables"."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    return {n for row in section.splitlines() if row.startswith("| `")
            for n in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}


def test_every_environment_variable_read_is_documented():
    missing = {n: f for n, f in variables_read().items() if n not in documented()}
    assert not missing, f"read but not listed in docs/usage.md's Environment variables: {missing}"


def test_every_documented_environment_variable_is_in_the_code():
    code = "\n".join(p.read_text(errors="replace") for p in code_files())
    stale = sorted(n for n in documented() if not re.search(rf"\b{n}\b", code))
    assert not stale, f"listed in docs/usage.md but named nowhere in the code: {stale}"


def test_the_readme_points_to_the_list():
    assert "docs/usage.md#environment-variables" in (ROOT / "README.md").read_text()
