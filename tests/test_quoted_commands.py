"""Every command quoted in README.md and docs/*.md that runs one of our entry points (engine.py,
serve.py, quantize.py, scripts/*.py, python -m eval.*) parses with that entry point's own argument
parser, and passes the checks its CLI makes before loading a model (policy specs, the benchmark's
flag checks, the eval suite's options).  Nothing runs: the parser's parse_args is intercepted.

A failure names file:line, the command and the parser's message.  Elided commands
(`python scripts/benchmark.py ... --op attention`) are checked with the `...` removed; a missing
required argument is then accepted (the elision stands for it).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOT_SCRIPTS = {"engine.py", "serve.py", "quantize.py"}
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)"}
ENV = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
FENCE = re.compile(r"^\s*(```|~~~)")
SPAN = re.compile(r"`([^`]+)`")          # inline code; may span lines of one paragraph
REQUIRED = "the following arguments are required"


@dataclass
class Quoted:
    where: str          # file:line
    text: str           # the command as quoted
    entry: str          # engine.py | scripts/benchmark.py | eval.needle | ...
    argv: list[str]
    elided: bool


# --------------------------------------------------------------------------- extraction

def entry_point(tokens: list[str], code: bool):
    """(entry, argv) of a tokenized command line, or None when it runs none of ours.  In prose a
    command may also start with the script (`scripts/download.py model REPO_ID`)."""
    while tokens and ENV.fullmatch(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "torchrun":                  # torchrun [its flags] SCRIPT args
        i = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
        return None if i is None else _script(tokens[i], tokens[i + 1:])
    if tokens[0] in PYTHONS:
        if tokens[1:2] == ["-m"] and len(tokens) > 2:
            mod = tokens[2]
            return (mod, tokens[3:]) if mod.startswith("eval.") and mod != "eval.common" else None
        return _script(tokens[1], tokens[2:]) if len(tokens) > 1 else None
    if not code and len(tokens) > 1 and tokens[0].startswith("scripts/"):
        return _script(tokens[0], tokens[1:])
    return None


def _script(path: str, argv: list[str]):
    path = path.removeprefix("./")
    if path in ROOT_SCRIPTS or (path.startswith("scripts/") and path.endswith(".py") and path.count("/") == 1):
        return path, argv
    return None


def logical_lines(text: str):
    """(line number, text) of code: fenced or 4-space-indented lines (backslash continuations
    joined), and inline code spans of the prose (which may wrap)."""
    lines = text.split("\n")
    prose = list(lines)
    fenced, indented, i = False, False, 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            fenced, prose[i] = not fenced, ""
            i += 1
            continue
        # an indented block starts after a blank line (else the line continues a list item's prose)
        indented = line.startswith("    ") and (indented or i == 0 or not lines[i - 1].strip())
        if fenced or indented:
            start, joined = i, line.strip()
            prose[i] = ""
            while joined.endswith("\\") and i + 1 < len(lines):
                i += 1
                joined, prose[i] = joined[:-1] + " " + lines[i].strip(), ""
            yield start + 1, joined, True
        i += 1
    body = "\n".join(prose)
    for m in SPAN.finditer(body):
        if "\n\n" not in m.group(1):
            yield body.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()), False


def quoted_commands() -> list[Quoted]:
    found = []
    for path in DOCS:
        for line, text, code in logical_lines(path.read_text()):
            try:
                tokens = shlex.split(text, comments=code)
            except ValueError:
                continue                        # not a shell line (unbalanced quotes in prose)
            hit = entry_point(tokens, code)
            if hit is None or not hit[1]:       # no arguments: a mention (`python quantize.py`), no flags to check
                continue
            entry, argv = hit
            elided = "..." in argv
            found.append(Quoted(f"{path.relative_to(ROOT)}:{line}", text, entry,
                                [a for a in argv if a != "..."], elided))
    return found


# --------------------------------------------------------------------------- checking

class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


class _Refused(Exception):
    pass


@contextmanager
def parse_only():
    """argparse stops right after a successful top-level parse (raising _Parsed) and raises
    _Refused instead of exiting on an error."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    def error(self, message):
        raise _Refused(message)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(argparse.ArgumentParser, "error", error):
        yield


_MODULES: dict[str, object] = {}


def load_entry(entry: str):
    if entry not in _MODULES:
        if entry in ROOT_SCRIPTS:               # engine.py, serve.py, quantize.py: the modules the tests import
            module = importlib.import_module(Path(entry).stem)
        elif entry.endswith(".py"):
            name = "_quoted_" + Path(entry).stem
            spec = importlib.util.spec_from_file_location(name, ROOT / entry)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(entry)
        _MODULES[entry] = module
    return _MODULES[entry]


def check_options(entry: str, ns: argparse.Namespace) -> None:
    """The checks each CLI makes after parsing and before loading a model (raise on bad input)."""
    import engine
    from cache import make_policy
    if entry == "scripts/benchmark.py":
        from bench import cli
        cli.check_options(ns)
    elif entry in ("eval.suite", "scripts/accuracy_table.py"):
        from eval import suite
        suite.resolve_options(ns)
        suite.parse_policies(ns.policies)
        suite.parse_tasks(ns.tasks)
    elif entry == "eval.lm_eval_adapter":      # lm-eval's own CLI: our keys are in --model_args
        from eval import lm_eval_adapter
        lm_eval_adapter.new_policy(lm_eval_adapter.parse_settings(ns.model_args))
    elif all(hasattr(ns, a) for a in ("policy", "kv_bits", "kv_dtype", "dtype", "device")):
        engine.kv_policy(make_policy(ns.policy, getattr(ns, "policy_args", "")), ns)


def refusal(q: Quoted):
    """None if the command parses and passes its CLI's checks, else the message."""
    module = load_entry(q.entry)
    try:
        with parse_only():
            module.main(q.argv)
    except _Parsed as parsed:
        try:
            check_options(q.entry, parsed.namespace)
        except Exception as e:                  # noqa: BLE001 - every refusal is reported
            return f"{type(e).__name__}: {e}"
        return None
    except _Refused as e:
        if q.elided and REQUIRED in str(e):
            return None
        return f"argparse: {e}"
    return f"{q.entry}'s main returned without parsing its arguments"


# --------------------------------------------------------------------------- tests

def test_the_docs_quote_commands_of_every_kind():
    """The extractor finds the documented commands (a broken extractor would pass everything)."""
    entries = {q.entry for q in quoted_commands()}
    for expected in ("engine.py", "serve.py", "quantize.py", "scripts/benchmark.py", "scripts/peers.py",
                     "scripts/download.py", "scripts/reproduce.py", "eval.suite", "eval.needle", "eval.lm_eval_adapter"):
        assert expected in entries, f"no quoted command runs {expected}"


def test_the_checker_refuses_what_the_cli_refuses():
    bad = [Quoted("x:1", "", "scripts/benchmark.py", ["--policies", "full,streaming"], False),
           Quoted("x:2", "", "scripts/benchmark.py", ["--policy-args", "budget=1"], False),
           Quoted("x:3", "", "engine.py", ["--checkpoint", "c", "--no-such-flag"], False),
           Quoted("x:4", "", "eval.similarity", ["--policy", "snapkv"], False),
           Quoted("x:5", "", "engine.py", ["--checkpoint", "c", "--policy", "pod", "--kv-bits", "4"], False),
           Quoted("x:7", "", "eval.lm_eval_adapter", ["--model_args", "checkpoint=c,policy=nosuch", "--tasks", "t"], False),
           Quoted("x:8", "", "eval.lm_eval_adapter", ["--model_args", "checkpoint=c,polcy=full", "--tasks", "t"], False)]
    for q in bad:
        assert refusal(q) is not None, q.argv
    assert refusal(Quoted("x:6", "", "engine.py", ["--checkpoint", "c", "--policy", "snapkv:budget=64"],
                          False)) is None
    assert refusal(Quoted("x:9", "", "eval.lm_eval_adapter", ["--model_args", 'checkpoint=c,policy="snapkv:budget=64,obs_window=8"',
                                                              "--tasks", "t"], False)) is None


def test_every_quoted_command_parses():
    failures = []
    for q in quoted_commands():
        why = refusal(q)
        if why is not None:
            failures.append(f"{q.where}: {q.text}\n    -> {why}")
    assert not failures, "quoted commands refused by their parsers:\n" + "\n".join(failures)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
