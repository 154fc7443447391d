"""What a developer sees: the one line before the C++ kernels' first build (kernels/cpu.py), every
environment variable the code reads listed in docs/usage.md, and `make test`'s per-file durations."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

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


def test_two_checkouts_of_the_same_kernels_build_apart(tmp_path, monkeypatch):
    """torch's build file names the sources by absolute path: one build shared by two checkouts would be
    rebuilt whole at every switch (what made a targeted pytest file take minutes), with no line printed."""
    import shutil
    here = cpu.extension_name()
    copies = []
    for p in cpu.SOURCES + cpu.HEADERS:
        copies.append(Path(shutil.copy(p, tmp_path / p.name)))
    monkeypatch.setattr(cpu, "SOURCES", copies[:len(cpu.SOURCES)])
    monkeypatch.setattr(cpu, "HEADERS", copies[len(cpu.SOURCES):])
    assert cpu.extension_name() != here


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


# --------------------------------------------------------------------------- make test's durations file

def test_durations_text_sums_per_file_slowest_first():
    from tests.conftest import durations_text
    text = durations_text({"tests/test_a.py": [1.5, 3], "tests/test_b.py": [20.25, 1]}, 1)
    lines = text.splitlines()
    assert lines[0].startswith("# seconds per test file") and "22 s over 2 files, exit status 1" in lines[0]
    assert lines[1].split() == ["20.2", "s", "1", "tests", "tests/test_b.py"]
    assert lines[2].split() == ["1.5", "s", "3", "tests", "tests/test_a.py"]


def test_make_test_keeps_the_durations_and_pytests_exit_status():
    """The file the README names; no pipe in the recipe (a `| tee` would return tee's status)."""
    make = subprocess.run(["make", "-n", "test", "test-fast"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "VENV": str(ROOT / ".venv")})
    runs = [line for line in make.stdout.splitlines() if " -m pytest " in line]
    assert len(runs) == 2, make.stdout + make.stderr
    for line in runs:
        assert "--durations-file=runs/test-durations.txt" in line and "|" not in line
    assert "runs/test-durations.txt" in (ROOT / "README.md").read_text()


def test_the_durations_file_is_written_at_the_end(tmp_path):
    out = tmp_path / "durations.txt"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        f"--durations-file={out}", "tests/test_dev_feedback.py", "-k", "sums_per_file"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_text().splitlines()[1].endswith("1 tests  tests/test_dev_feedback.py")
