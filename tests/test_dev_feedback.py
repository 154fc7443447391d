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
