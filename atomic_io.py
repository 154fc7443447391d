"""All-or-nothing writes: every file and checkpoint directory the project writes goes to a hidden
temporary name in the same directory and is renamed over its target only when complete, so an
interrupted run (Ctrl-C, SIGTERM, a crash, a full disk) leaves the old file or nothing, never half.

    with atomic_file(path, "wb") as f: ...      # one file
    write_text(path, text); write_json(path, obj)
    with atomic_dir(out) as tmp: ...            # a directory (a checkpoint), swapped in at the end

`exit_on_sigterm()` turns SIGTERM into SystemExit(143) so the temporaries are removed on the way out
(SIGKILL leaves a hidden `.NAME.tmp-PID` behind, never a file under the target's name).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

def temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def _signals_blocked():
    """SIGINT/SIGTERM held back while a commit's renames run (delivered right after)."""
    mask = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def atomic_file(path, mode: str = "w", **kwargs):
    """Open a temporary sibling of `path`; on a clean exit fsync it and rename it over `path`, on any
    exception (KeyboardInterrupt, SystemExit included) delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path, text: str) -> Path:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def write_json(path, obj, **dump_kwargs) -> Path:
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, **dump_kwargs)
        f.write("\n")
    return Path(path)


@contextmanager
def atomic_dir(path):
    """Yield an empty temporary sibling directory of `path`; on a clean exit it replaces `path` (an old
    directory there is moved aside and deleted after the swap, with SIGINT/SIGTERM held back), on any
    exception it is deleted.  Refuses to replace a non-empty directory that holds no config.json (not a
    checkpoint: likely a mistyped --out)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / "config.json").is_file())):
        raise FileExistsError(f"{path} exists and is not a checkpoint directory (no config.json); "
                              f"not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = temp_sibling(path), path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        with _signals_blocked():
            if path.exists():
                os.rename(path, old)
            os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit(143) in the main thread, so pending temporaries are cleaned up."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
