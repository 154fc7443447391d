"""RULER-format synthetic tasks, generated here from a seed and the repository's text (no download:
RULER publishes its generator, not data), scored with RULER's metric, in either protocol.

    python -m eval.ruler_synth --tasks niah_single_2,vt,cwe --length 4096 --samples 5 --policy snapkv:budget=1024
    python -m eval.ruler_synth --tasks all --samples 20 --write DIR      # jsonl for eval.ruler or a RULER harness

Tasks (RULER's synthetic.yaml settings): needle retrieval, "One of the special magic numbers for
KEY is: VALUE." sentences hidden in a haystack, then asked for -
  niah_single_1/2/3   one needle; haystack: the classic repeated filler / the essays / the essays with
                      UUID values
  niah_multikey_1/2/3 four keys, one asked (essays) / a haystack of distractor needles / the same with
                      UUID keys and values
  niah_multivalue     four values of one key, all asked
  niah_multiquery     four keys, all asked
  vt                  variable tracking: one chain of 4 hops (VAR A = 12345, VAR B = VAR A, ...) hidden in
                      the filler; every variable holding the value is asked for
  cwe                 common words: a numbered list where 10 words appear 30 times and the others 3 times;
                      the 10 most common are asked for
Templates and answer prefixes are RULER's (scripts/data/synthetic/constants.py, the typo "assgined"
included).  Differences from RULER: keys are two words of the essays' vocabulary joined by "-"
(RULER: wonderwords adjective-noun pairs), cwe words come from the same vocabulary and its prompt
has no worked example, and needles go at seeded random sentence boundaries.

Each prompt, chat template included (--no-chat: plain), is at most --length minus the task's
generation length tokens (RULER's rule), the haystack grown by binary search.  Rows hold `context`
(template head + the text before the question) and `question` (the question + the template's end),
so they run in both protocols (eval/ruler.py: aware compresses the whole prompt, agnostic the context
alone, then appends the question whole).  The metric is RULER's string_match_all: the share of the
expected strings found in the answer, case-insensitive; a task's score is the mean x 100.  The same
--seed, tokenizer and settings give the same rows.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import atomic_io  # noqa: E402
from eval import common, ruler  # noqa: E402
from eval.common import UsageError  # noqa: E402
from runtime.context import SENTINEL  # noqa: E402

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
TEMPLATES = {   # RULER's (template, answer prefix, tokens to generate)
    "niah": ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_v} for {query} mentioned in the provided text?",
             " The special magic {type_v} for {query} mentioned in the provided text are", 128),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assgined the value {query}, they are: ", 30),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
            "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
            "above list?", " Answer: The top 10 words that appear most often in the list are:", 120),
}


@dataclass(frozen=True)
class Niah:
    haystack: str           # noise, essay or needle
    type_k: str = "words"   # words or uuids
    type_v: str = "numbers"  # numbers or uuids
    keys: int = 1           # needles with distinct keys
    values: int = 1         # values per key
    queries: int = 1        # keys asked for


TASKS: dict = {
    "niah_single_1": Niah("noise"), "niah_single_2": Niah("essay"), "niah_single_3": Niah("essay", type_v="uuids"),
    "niah_multikey_1": Niah("essay", keys=4), "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": Niah("essay", values=4), "niah_multiquery": Niah("essay", keys=4, queries=4),
    "vt": "vt", "cwe": "cwe",
}


# --------------------------------------------------------------------------- text from data/

@dataclass
class Source:
    """The essays' sentences (in file order) and vocabulary (sorted lowercase words of 3-10 letters)."""
    sentences: list[str]
    words: list[str]

    @classmethod
    def read(cls, folder=common.ESSAYS) -> "Source":
        text = common.read_text_folder(folder)
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]
        words = sorted({w.lower() for w in re.findall(r"\b[A-Za-z]{3,10}\b", text)})
        return cls(sentences, words)


def make_value(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids" else str(rng.randint(10 ** 6, 10 ** 7 - 1))


def make_key(rng: random.Random, kind: str, words: list[str]) -> str:
    return make_value(rng, "uuids") if kind == "uuids" else f"{rng.choice(words)}-{rng.choice(words)}"


def distinct(make: Callable[[], str], n: int, taken: set) -> list[str]:
    out = []
    while len(out) < n:
        x = make()
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


# --------------------------------------------------------------------------- one sample

@dataclass
class Sample:
    """A task instance before its haystack is sized: `units(n)` is the context's text for a haystack of n
    units, the question's fields fill the template."""
    units: Callable[[int], str]
    query: str
    outputs: list[str]
    num_v: int = 0


def insert_at(rng: random.Random, haystack: list[str], needles: list[str]) -> list[str]:
    """The haystack with each needle at a seeded random boundary (needles keep their order)."""
    spots = sorted(rng.randint(0, len(haystack)) for _ in needles)
    out, last = [], 0
    for spot, needle in zip(spots, needles):
        out += haystack[last:spot] + [needle]
        last = spot
    return out + haystack[last:]


def niah_sample(task: Niah, rng: random.Random, source: Source) -> Sample:
    taken: set = set()
    keys = distinct(lambda: make_key(rng, task.type_k, source.words), task.keys, taken)
    values = {k: distinct(lambda: make_value(rng, task.type_v), task.values, taken) for k in keys}
    needles = [NEEDLE.format(type_v=task.type_v, key=k, value=v) for k in keys for v in values[k]]
    rng.shuffle(needles)
    asked = rng.sample(keys, task.queries)
    start, place = rng.randrange(len(source.sentences)), rng.random()

    def units(n: int) -> str:
        if task.haystack == "noise":
            hay = [NOISE] * n
        elif task.haystack == "essay":
            hay = [source.sentences[(start + i) % len(source.sentences)] for i in range(n)]
        else:                                    # distractor needles, seeded by n so each size is fixed
            r = random.Random(f"{start}-{n}")
            hay = [NEEDLE.format(type_v=task.type_v, key=make_key(r, task.type_k, source.words),
                                 value=make_value(r, task.type_v)) for _ in range(n)]
        return " ".join(insert_at(random.Random(place), hay, needles))

    return Sample(units, join_query(asked), [v for k in asked for v in values[k]])


def vt_sample(rng: random.Random, hops: int = 4) -> Sample:
    names = distinct(lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)), hops + 1, set())
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    seed = rng.random()
    return Sample(lambda n: " ".join(insert_at(random.Random(seed), [NOISE] * n, chain)), value, names, len(names))


def cwe_sample(rng: random.Random, source: Source, common_words: int = 10, freq_common: int = 30,
               freq_rare: int = 3) -> Sample:
    words = rng.sample(source.words, len(source.words))
    frequent, rare = words[:common_words], words[common_words:]
    seed = rng.random()

    def units(n: int) -> str:
        listed = frequent * freq_common + rare[:n] * freq_rare
        random.Random(seed).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))

    return Sample(units, "", frequent)


# --------------------------------------------------------------------------- rows

def template(name: str) -> tuple[str, str, int]:
    return TEMPLATES["niah" if name.startswith("niah") else name]


def chat_wrap(tokenizer, chat: bool) -> tuple[str, str]:
    """(text before, text after) the user turn's content in the chat template with the generation prompt."""
    if not chat:
        return "", ""
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}],
                                                 add_generation_prompt=True)
    except ValueError as e:
        raise UsageError(f"{e} (--no-chat for plain prompts)") from None
    head, tail = rendered.split(SENTINEL)
    return head, tail


def build_row(name: str, sample: Sample, n: int, wrap: tuple[str, str], type_v: str) -> dict:
    """The RULER-format row of `sample` with n haystack units, inside wrap = chat_wrap(...)."""
    text, prefix, new = template(name)
    fields = dict(type_v=type_v, query=sample.query, num_v=sample.num_v)
    before, after = text.split("{context}")
    head, tail = wrap
    context = head + before.format(**fields) + sample.units(n)
    question = after.format(**fields) + tail
    return {"task": name, "input": context + question, "context": context, "question": question,
            "answer_prefix": prefix.format(**fields), "outputs": sample.outputs, "max_new_tokens": new}


def fit(tokenizer, name: str, sample: Sample, length: int, wrap: tuple[str, str], type_v: str) -> dict:
    """The row with the largest haystack whose prompt is at most length - generation tokens (binary search)."""
    limit = length - template(name)[2]
    size = lambda n: len(ruler.row_ids(tokenizer, build_row(name, sample, n, wrap, type_v))[0])  # noqa: E731
    lo, hi = 0, 1
    while size(hi) <= limit:
        if hi > 10 ** 6:
            raise UsageError(f"--length {length}: the {name} haystack cannot grow that long")
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= limit else (lo, mid)
    if size(lo) > limit:
        raise UsageError(f"--length {length}: the {name} template and question alone do not fit")
    row = build_row(name, sample, lo, wrap, type_v)
    row["length"] = size(lo)
    return row


def generate(tokenizer, name: str, length: int = 4096, samples: int = 10, seed: int = 0, chat: bool = True,
             source: Optional[Source] = None) -> list[dict]:
    """`samples` rows of task `name` (seeded by seed, name and row index)."""
    if name not in TASKS:
        raise UsageError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    source = source or Source.read()
    wrap, rows = chat_wrap(tokenizer, chat), []
    for i in range(samples):
        rng = random.Random(f"{seed}-{name}-{i}")
        task = TASKS[name]
        if name == "vt":
            sample, type_v = vt_sample(rng), ""
        elif name == "cwe":
            sample, type_v = cwe_sample(rng, source), ""
        else:
            sample, type_v = niah_sample(task, rng, source), task.type_v
        rows.append({"index": i, **fit(tokenizer, name, sample, length, wrap, type_v)})
    return rows


def parse_tasks(text: str) -> list[str]:
    names = list(TASKS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise UsageError(f"unknown task(s) {', '.join(unknown) or '(none)'}; tasks: {', '.join(TASKS)} or all")
    return names


def protocols(text: str) -> list[str]:
    """--protocol aware | agnostic | both -> the list to run."""
    return ["aware", "agnostic"] if text == "both" else [text]


# --------------------------------------------------------------------------- CLI

def build_parser():
    p = common.base_parser(__doc__)
    p.add_argument("--tasks", default="all", help=f"comma-separated, or all: {', '.join(TASKS)}")
    p.add_argument("--length", type=int, default=4096, help="tokens of prompt + generation (default: %(default)s)")
    p.add_argument("--samples", type=int, default=10, help="rows per task (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="plain prompts, no chat template")
    p.add_argument("--protocol", choices=["aware", "agnostic", "both"], default="both",
                   help="aware: the prompt with its question compressed; agnostic: the context without it; "
                        "both (default)")
    p.add_argument("--write", metavar="DIR", help="write each task's rows to DIR/NAME.jsonl and exit")
    return p


def run(args) -> int:
    names = parse_tasks(args.tasks)
    if args.samples < 1 or args.length < 1:
        raise UsageError("--samples and --length must be at least 1")
    common.new_policy(args)
    loaded = common.load(args)
    common.check_fits(loaded, args.length, "--length")
    source = Source.read()
    data = {n: generate(loaded.tokenizer, n, args.length, args.samples, args.seed, args.chat, source) for n in names}
    if args.write:
        Path(args.write).mkdir(parents=True, exist_ok=True)
        for n, rows in data.items():
            atomic_io.write_text(Path(args.write) / f"{n}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(names)} tasks x {args.samples} rows to {args.write}")
        return 0
    results = []
    for protocol in protocols(args.protocol):
        for n, rows in data.items():
            r = ruler.evaluate(loaded, lambda: common.new_policy(args), rows, "all", 128, n,
                               common.Progress(len(rows)), args.compile, protocol)
            print(f"{n} [{protocol}]: {r['metric']} {r['score']:.1f}")
            results.append({**r, "protocol": protocol})
    if args.json:
        common.write_json(args.json, {**common.report_header(args), "length": args.length, "samples": args.samples,
                                      "seed": args.seed, "chat": args.chat, "tasks": results})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.main_wrapper(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
