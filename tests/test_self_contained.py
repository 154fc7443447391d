"""The product reads nothing outside its own checkout: no tracked file names a folder beside it or an
absolute home/work path, and the data the tests and evals need is in data/."""
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIBLING = ".." + "/shared"                      # written in two parts so this file does not match itself
FORBIDDEN = re.compile("|".join([re.escape(SIBLING), r"(?<![\w.])/(?:work|home|root|Users)/[\w.]"]))
SKIP_DIRS = {".git", ".venv", "checkpoints", "runs", "__pycache__", "build", "downloaded"}


def tracked_files(root: Path) -> list[Path]:
    """Files git tracks under root (every file but build/venv/model folders outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        return [root / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in root.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts)]


def outside_paths(files: list[Path]) -> list[str]:
    """'file:line: text' for every line that names a path outside the checkout."""
    hits = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{f}:{i}: {line.strip()[:120]}")
    return hits


def test_no_tracked_file_names_a_path_outside_the_checkout():
    files = tracked_files(ROOT)
    assert len(files) > 50
    assert outside_paths(files) == []


@pytest.mark.parametrize("line", [f"ESSAYS = ROOT.parent / 'x' / '{SIBLING}/data'", "cat " + SIBLING + "/DESIGN.md",
                                  "glob('/" + "work/main/data/*.txt')", "open('/" + "home/alice/model.gguf')",
                                  "p = '/" + "root/.cache/x'"])
def test_the_scan_catches_outside_paths(tmp_path, line):
    f = tmp_path / "bad.py"
    f.write_text(f"x = 1\n{line}\n")
    assert outside_paths([f]) == [f"{f}:2: {line}"]


@pytest.mark.parametrize("line", ["url = 'https://example.com/work/x'", "path = ROOT / 'data' / 'work'",
                                  "a = b/work/c", "see docs/design.md"])
def test_the_scan_lets_inside_paths_be(tmp_path, line):
    f = tmp_path / "ok.py"
    f.write_text(line + "\n")
    assert outside_paths([f]) == []


def test_bundled_data_is_there_and_small():
    data = ROOT / "data"
    essays = sorted((data / "paul_graham_essays").glob("*.txt"))
    calibration = sorted((data / "calibration").glob("*.txt"))
    assert len(essays) == 41 and len(calibration) == 8
    assert not {p.name for p in essays} & {p.name for p in calibration}, "calibration text must be held aside"
    rows = [json.loads(x) for x in (data / "longbench" / "multi_news.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all({"input", "context", "answers"} <= set(r) for r in rows)
    shipped = [p for p in tracked_files(ROOT) if p.is_relative_to(data)]
    assert sum(p.stat().st_size for p in shipped) <= 3 * 1024 * 1024
    readme = (data / "README.md").read_text()
    for name in ("paul_graham_essays/", "calibration/", "multi_news.jsonl", "license"):
        assert name in readme
