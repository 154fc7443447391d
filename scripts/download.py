"""Fetch data and models from the HuggingFace hub (needs network access and `huggingface_hub`:
pip install -e '.[download]').  Nothing in the tests or `make` calls this; the repository ships
what they need in data/.

    python scripts/download.py longbench [--tasks hotpotqa,multi_news,...]   # LongBench (THUDM/LongBench)
    python scripts/download.py ruler REPO_ID [--pattern '*.jsonl']          # RULER-format jsonl files
    python scripts/download.py model REPO_ID [--token HF_TOKEN]              # a model into checkpoints/

LongBench: the official `data.zip` of the THUDM/LongBench dataset repository (114 MB, every task
as `<task>.jsonl`); the requested tasks (default: the 16 English ones eval/longbench_tasks.json
knows, plus their LongBench-E variants) are extracted to data/downloaded/longbench/, where
`python -m eval.longbench --data NAME` and the eval suite's `longbench:NAME` look first.

RULER publishes generators, not data: its samples depend on the tokenizer and the length.  Make
them with RULER's own `prepare.py`, or offline with `python -m eval.passkey --write-ruler FILE`,
or fetch a dataset repository of RULER-format jsonl files (`input`, `outputs`) that someone
generated; they land in data/downloaded/ruler/REPO_NAME/ for `python -m eval.ruler --data FILE`.

Offline (or without huggingface_hub) the script says what to fetch and where to put it, and
exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOWNLOADS = ROOT / "data" / "downloaded"
sys.path.insert(0, str(ROOT))

import atomic_io  # noqa: E402

LONGBENCH_REPO = "THUDM/LongBench"
MODEL_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


class DownloadError(Exception):
    """A download that could not happen: the message says what to do instead."""


def hub():
    try:
        import huggingface_hub
    except ImportError:
        raise DownloadError("scripts/download.py needs huggingface_hub: pip install -e '.[download]'") from None
    return huggingface_hub


def reachable_hub() -> None:
    """DownloadError at once when the hub's host name does not resolve (no network), instead of the
    client's retries."""
    from urllib.parse import urlparse
    hub()
    from huggingface_hub import constants
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise DownloadError(f"{host} is not reachable from this machine ({e.strerror or e})") from None


def fetch(what: str, manual: str, call):
    """Run call() (a hub download); network failures become a DownloadError naming `manual`."""
    try:
        reachable_hub()
        return call()
    except Exception as e:  # the hub raises many types (offline, 404, gated, timeouts): report, don't trace
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DownloadError(f"could not download {what}: {reason[:200]}\n"
                            f"Without network access, fetch it on another machine and {manual}") from None


def english_tasks() -> list[str]:
    tasks = json.loads((ROOT / "eval" / "longbench_tasks.json").read_text())["tasks"]
    return sorted(tasks) + sorted(f"{t}_e" for t in tasks)


def download_longbench(tasks: list[str], dest: Path) -> list[Path]:
    manual = (f"copy the files of `data/` inside https://huggingface.co/datasets/{LONGBENCH_REPO}/"
              f"blob/main/data.zip (<task>.jsonl) to {dest}/")
    zip_path = fetch(f"{LONGBENCH_REPO} data.zip", manual, lambda: hub().hf_hub_download(
        LONGBENCH_REPO, "data.zip", repo_type="dataset"))
    dest.mkdir(parents=True, exist_ok=True)
    written, missing = [], []
    with zipfile.ZipFile(zip_path) as z:
        members = {Path(n).stem: n for n in z.namelist() if n.endswith(".jsonl")}
        for task in tasks:
            if task not in members:
                missing.append(task)
                continue
            out = dest / f"{task}.jsonl"
            with z.open(members[task]) as src, atomic_io.atomic_file(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            written.append(out)
    if missing:
        print(f"warning: not in {LONGBENCH_REPO}'s data.zip: {', '.join(missing)}", file=sys.stderr)
    return written


def download_repo(repo_id: str, dest: Path, patterns: list[str], repo_type: str, token=None,
                  revision=None) -> Path:
    manual = f"copy the repository's files matching {', '.join(patterns)} to {dest}/"
    fetch(repo_id, manual, lambda: hub().snapshot_download(
        repo_id, local_dir=dest, allow_patterns=patterns, repo_type=repo_type, token=token, revision=revision))
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    lb = sub.add_parser("longbench", help="LongBench tasks into data/downloaded/longbench/")
    lb.add_argument("--tasks", help="comma-separated task names (default: the English tasks and their _e variants)")
    lb.add_argument("--dest", type=Path, default=DOWNLOADS / "longbench")
    ru = sub.add_parser("ruler", help="RULER-format jsonl files from a dataset repository")
    ru.add_argument("repo_id")
    ru.add_argument("--pattern", action="append", help="file patterns to fetch (default: *.jsonl)")
    ru.add_argument("--dest", type=Path, help="default: data/downloaded/ruler/REPO_NAME")
    mo = sub.add_parser("model", help="a model repository into checkpoints/")
    mo.add_argument("repo_id")
    mo.add_argument("--dest", type=Path, default=ROOT / "checkpoints")
    mo.add_argument("--token", help="HF access token for gated models")
    mo.add_argument("--revision")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.what == "longbench":
            tasks = [t.strip() for t in a.tasks.split(",") if t.strip()] if a.tasks else english_tasks()
            for path in download_longbench(tasks, a.dest):
                print(f"wrote {path}")
        elif a.what == "ruler":
            dest = a.dest or DOWNLOADS / "ruler" / a.repo_id.split("/")[-1]
            print(f"downloaded {a.repo_id} to {download_repo(a.repo_id, dest, a.pattern or ['*.jsonl'], 'dataset')}")
        else:
            dest = a.dest / a.repo_id.split("/")[-1]
            download_repo(a.repo_id, dest, MODEL_PATTERNS, "model", a.token, a.revision)
            print(f"downloaded {a.repo_id} to {dest}")
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
