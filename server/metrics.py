"""Prometheus text exposition (format 0.0.4), written by hand for serve.py's GET /metrics: no dependency.

    families = [Family("kvserve_queue_depth", "gauge", "requests waiting for a row", [({"policy": "full"}, 3)])]
    text = exposition(families)

A histogram's samples come from `Histogram.samples` (cumulative `_bucket{le=...}` lines, `_sum`, `_count`).
"""
from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field


@dataclass
class Family:
    """One metric: its name, type (counter, gauge, histogram), help text and samples [(labels, value)]; a
    histogram's samples carry their own suffixes (`Histogram.samples`)."""
    name: str
    kind: str
    help: str
    samples: list = field(default_factory=list)      # [(labels dict, value)] or [(suffix, labels dict, value)]


class Histogram:
    """Observations counted into fixed upper bounds (seconds, say); not thread-safe (the caller locks)."""

    def __init__(self, bounds: tuple):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)       # the last one: above every bound (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self, labels: dict) -> list:
        """[(suffix, labels, value)]: the cumulative buckets (le="+Inf" last), _sum and _count."""
        out, total = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            total += n
            out.append(("_bucket", {**labels, "le": number(bound)}, total))
        return out + [("_sum", labels, self.sum), ("_count", labels, self.count)]


def number(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(float(x))


def label_text(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")   # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def exposition(families: list[Family]) -> str:
    """The text format: `# HELP`, `# TYPE`, then one line per sample."""
    lines = []
    for f in families:
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.kind}"]
        for sample in f.samples:
            suffix, labels, value = sample if len(sample) == 3 else ("", *sample)
            lines.append(f"{f.name}{suffix}{label_text(labels)} {number(value)}")
    return "\n".join(lines) + "\n"


def resident_bytes():
    """This process's resident set size now (Linux's /proc/self/statm), or None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None
