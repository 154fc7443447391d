"""The accuracy table a user reads to choose a policy: every policy at its defaults, at 64, 128 and
256 tokens per layer and KV head (sparse readers at the HShare paper's presets and sharing ratios),
KIVI 4/2-bit; needle at 1000/3000 tokens x 3 depths on the bundled haystack, perplexity over
2048 + 256 tokens of the held-aside essays, and KV bytes.  It is the eval suite's `accuracy` preset
(resumable: run it again to finish an interrupted table; results.md in --out holds the table).

    python scripts/accuracy_table.py --out runs/accuracy
    python scripts/accuracy_table.py --out runs/accuracy --policies 'snapkv@a:head_agg=mean; snapkv@b:head_agg=max'
    python scripts/accuracy_table.py --out runs/longbench --tasks longbench:multi_news --limit 10

Any other eval-suite flag passes through (python -m eval.suite --help).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval import suite  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
    return suite.main(["--preset", "accuracy", *argv])


if __name__ == "__main__":
    sys.exit(main())
