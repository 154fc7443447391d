"""The OpenAI-compatible server's command (server/: app.py its app and CLI, loop.py the engine loop).

    python serve.py --checkpoint checkpoints/SmolLM2-135M-Instruct --policies 'full; snapkv:budget=256' --port 8000

It prints "loading CHECKPOINT ..." on stderr, the C++ kernels' one line if they are built now (minutes, once), and,
once it accepts connections, where it listens ("serving on http://127.0.0.1:8000").
"""
from __future__ import annotations

import os
import sys


def wait_policy_flag(argv: list[str]) -> str:
    """--omp-wait-policy's value in argv (default "default"; argparse validates it later)."""
    for i, a in enumerate(argv):
        if a.startswith("--omp-wait-policy="):
            return a.split("=", 1)[1]
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1]
    return "default"


if __name__ == "__main__":
    # OpenMP reads its wait policy once, when torch is imported: --omp-wait-policy takes effect here
    if (wait_policy := wait_policy_flag(sys.argv)) in ("passive", "active"):
        os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()
    elif wait_policy == "default":              # OpenMP's own: spin a short while after each op, then sleep
        os.environ.pop("OMP_WAIT_POLICY", None)

from server.app import main  # noqa: E402  (after the wait policy: server.app imports torch)

if __name__ == "__main__":
    sys.exit(main())
