"""Scoring functions of LongBench and RULER, written from their definitions (no scoring package).

Every function scores ONE prediction against ONE reference and returns a float in [0, 1]; a
dataset's score is the mean over its rows (x 100 in the reports) of the best score over the
row's references (`best_of`), as LongBench's scorer does.

LongBench (English tasks):
  qa_f1           token F1 after `normalize_answer` (lower case, punctuation dropped, articles
                  a/an/the dropped, whitespace collapsed)
  rouge_l         summary-level ROUGE-L with the conventions of the `rouge` package LongBench
                  calls: sentences split at '.', whitespace tokens, case-sensitive, each word
                  counted once (the package's default "exclusive" mode), union LCS over sentence
                  pairs, F = 2PR / (P + R + 1e-8); an empty prediction scores 0
  classification  1 / (number of class names found in the prediction) when the true class is
                  among them, after dropping found names that are only substrings of the true one
  retrieval       share of the numbers in the prediction equal to the paragraph number in
                  "Paragraph N"
  count           share of the numbers in the prediction equal to the true count
  code_sim        edit similarity of the first prediction line that is not a comment or a code
                  fence to the reference line: round(100 * 2 * LCS / (len_a + len_b)) / 100, the
                  Levenshtein (insert/delete) ratio fuzzywuzzy reports
RULER:
  string_match_all  share of the references found in the prediction (case-insensitive)
  string_match_part 1 when any reference is found in the prediction (case-insensitive)
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


# --------------------------------------------------------------------------- QA F1

def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation, drop articles, collapse whitespace (SQuAD/LongBench)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """F1 of two token lists, counting repeated tokens as often as both have them."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


# --------------------------------------------------------------------------- ROUGE-L

def lcs_table(a: Sequence, b: Sequence) -> list[list[int]]:
    """table[i][j] = length of the longest common subsequence of a[:i] and b[:j]."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a, 1):
        row, prev = table[i], table[i - 1]
        for j, y in enumerate(b, 1):
            row[j] = prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1])
    return table


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, in O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b, 1):
            row.append(prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1]))
        prev = row
    return prev[-1]


def lcs(a: Sequence, b: Sequence) -> list:
    """One longest common subsequence of a and b (backtracking: diagonal on a match, else up
    when that keeps the length, else left)."""
    table, out = lcs_table(a, b), []
    i, j = len(a), len(b)
    while i and j:
        if a[i - 1] == b[j - 1]:
            out.append(a[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def _sentences(text: str) -> list[list[str]]:
    """Sentences split at '.' as the `rouge` package does: pieces of length 0 are dropped, a
    piece of only whitespace stays as one empty word (so "a. . b" has the word "")."""
    return [" ".join(s.split()).split(" ") for s in text.split(".") if s]


def rouge_l(prediction: str, reference: str, **_) -> float:
    """Summary-level ROUGE-L F (see the module docstring for the conventions)."""
    hyp, ref = _sentences(prediction), _sentences(reference)
    if not hyp or not ref:
        return 0.0
    n = len({w for s in hyp for w in s})          # distinct words of the prediction
    m = len({w for s in ref for w in s})          # distinct words of the reference
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union.update(lcs(r, h))
    precision, recall = len(union) / n, len(union) / m
    return 2 * precision * recall / (precision + recall + 1e-8)


# --------------------------------------------------------------------------- classification, retrieval, count

def classification(prediction: str, reference: str, all_classes: Optional[Iterable[str]] = None, **_) -> float:
    if not all_classes:
        raise ValueError("classification needs the row's all_classes")
    found = [c for c in all_classes if c in prediction]
    found = [c for c in found if not (c in reference and c != reference)]
    return 1.0 / len(found) if reference in found else 0.0


def retrieval(prediction: str, reference: str, **_) -> float:
    match = re.search(r"Paragraph (\d+)", reference)
    if match is None:
        raise ValueError(f"retrieval reference {reference!r} has no 'Paragraph N'")
    numbers = _NUMBER.findall(prediction)
    return sum(n == match.group(1) for n in numbers) / len(numbers) if numbers else 0.0


def count(prediction: str, reference: str, **_) -> float:
    numbers = _NUMBER.findall(prediction)
    return sum(n == str(reference) for n in numbers) / len(numbers) if numbers else 0.0


# --------------------------------------------------------------------------- code

def edit_ratio(a: str, b: str) -> float:
    """2 * LCS / (len(a) + len(b)): the Levenshtein ratio with insertions and deletions
    (a substitution costs 2), 1.0 for two empty strings."""
    if a == b:
        return 1.0
    return 2 * lcs_length(a, b) / (len(a) + len(b))


def code_sim(prediction: str, reference: str, **_) -> float:
    line = next((x for x in prediction.lstrip("\n").split("\n")
                 if "`" not in x and "#" not in x and "//" not in x), "")
    return round(100 * edit_ratio(line, reference)) / 100


# --------------------------------------------------------------------------- RULER

def string_match_all(prediction: str, references: Sequence[str]) -> float:
    p = prediction.lower()
    return sum(r.lower() in p for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    p = prediction.lower()
    return float(any(r.lower() in p for r in references))


def ruler_postprocess(prediction: str) -> str:
    """RULER's cleaning of a prediction: control characters become newlines, then strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


# --------------------------------------------------------------------------- registry

METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification, "retrieval": retrieval,
    "count": count, "code_sim": code_sim,
}


def best_of(metric: Callable[..., float], prediction: str, references: Sequence[str], **kwargs) -> float:
    """The best score over a row's references (LongBench's max over `answers`)."""
    if not references:
        raise ValueError("a row has no reference answers")
    return max(metric(prediction, r, **kwargs) for r in references)
