"""The benchmark's modes (one per run) and the protocol a new one follows.

A mode declares its own flags (its selector goes in the mutually exclusive group), validates them
before the model is loaded, says whether this run is its run, and measures: it hands every row,
finished or not, to `bench.writer.add` (rows need `mode`, `policy`, `policy_args`, `kv_bits`,
`context_length`, `status` and `error`; bench.base_row gives the common fields).  To add a mode
(as bench/soak.py did), write a module with a class like these and put an instance in MODES.
"""
from __future__ import annotations

import argparse
from typing import Protocol

from bench.attention import AttentionMode
from bench.grid import E2EMode, SweepMode
from bench.memory import MemoryMode
from bench.runner import Bench
from bench.soak import SoakMode


class Mode(Protocol):
    name: str          # the rows' "mode" field (and the plot's kind)

    def add_arguments(self, parser: argparse.ArgumentParser, exclusive) -> None:
        """Add the mode's flags: its selector to `exclusive` (the modes' mutually exclusive group)."""

    def check(self, o: argparse.Namespace) -> None:
        """Validate the mode's flags (called for every mode, before the model is loaded); raise
        specs.BenchmarkError for bad input.  May add parsed values to `o`."""

    def selected(self, o: argparse.Namespace) -> bool:
        """Whether this run is this mode's (its selector was given)."""

    def run(self, bench: Bench) -> None:
        """Measure and write the rows (KeyboardInterrupt propagates; other failures become rows)."""


# in --help order; the first selected one runs, so the default (e2e) comes last
MODES: list[Mode] = [AttentionMode(), SweepMode(), MemoryMode(), SoakMode(), E2EMode()]


def selected_mode(o: argparse.Namespace) -> Mode:
    return next(m for m in MODES if m.selected(o))
