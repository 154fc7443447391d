"""Run a program paused at a named point of its writes, for tests/test_atomic_writes.py to interrupt it there.

    python tests/pause_at.py POINT SCRIPT [ARG...]
    python tests/pause_at.py POINT -c CODE

POINT is "commit NAME" (just before atomic_io renames a finished temporary over NAME: atomic_file's replace,
atomic_dir's renames before their signals are held back) or "converted weights" (right after the weights file
of a converted directory is written: checkpoint.hf_dir's safetensors save_file).  At the point it says "paused at POINT" on stderr and
sleeps in short naps (a signal landing between the announcement and a long sleep would not interrupt it; between
naps Python runs the pending handler), so the product's modules carry no hook for this.
"""
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pause(point: str) -> None:
    print(f"paused at {point}", file=sys.stderr, flush=True)
    for _ in range(600):
        time.sleep(0.1)


def install(point: str) -> None:
    """Wrap the calls that sit at each point (the product's modules, imported here first, are the ones the
    program then imports)."""
    import safetensors.torch

    import atomic_io

    replace, blocked, save_file = os.replace, atomic_io._signals_blocked, safetensors.torch.save_file

    def paused_replace(src, dst, *args, **kwargs):            # atomic_file's commit
        if point == f"commit {Path(dst).name}":
            pause(point)
        return replace(src, dst, *args, **kwargs)

    def paused_blocked():                                     # atomic_dir's commit: its caller holds `path`
        path = sys._getframe(1).f_locals.get("path")
        if path is not None and point == f"commit {Path(path).name}":
            pause(point)
        return blocked()

    def paused_save_file(*args, **kwargs):
        out = save_file(*args, **kwargs)
        if point == "converted weights":
            pause(point)
        return out

    os.replace, atomic_io._signals_blocked = paused_replace, paused_blocked
    safetensors.torch.save_file = paused_save_file          # checkpoint.hf_dir imports it when it writes


def main() -> None:
    point, program, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path.insert(0, str(ROOT))
    install(point)
    if program == "-c":
        sys.argv = ["-c", *args[1:]]
        sys.path[0] = ""
        exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = [program, *args]
        sys.path[0] = str(Path(program).resolve().parent)
        runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
