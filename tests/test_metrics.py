"""eval/metrics.py against hand-computed cases, and the LongBench task table."""
import json

import pytest

from eval import longbench, metrics, prompts


# --------------------------------------------------------------------------- QA F1

def test_normalize_answer_drops_case_punctuation_articles_and_extra_space():
    assert metrics.normalize_answer("  The Cat, sat -- on AN old   mat!") == "cat sat on old mat"
    assert metrics.normalize_answer("theatre a-z") == "theatre az"          # articles only as whole words


def test_qa_f1_hand_computed():
    # pred tokens [cat, sat, on, mat], reference [cat, on, mat]: 3 shared, P 3/4, R 1
    assert metrics.qa_f1("The cat sat on the mat.", "a cat on a mat") == pytest.approx(2 * 0.75 / 1.75)
    # repeated tokens count min(pred, ref) times: {a: 1, b: 1} shared of 3 and 3 tokens
    assert metrics.token_f1(["a", "a", "b"], ["a", "b", "b"]) == pytest.approx(2 / 3)
    assert metrics.qa_f1("Paris", "paris.") == 1.0
    assert metrics.qa_f1("London", "Paris") == 0.0
    assert metrics.qa_f1("the", "Paris") == 0.0                        # nothing left after normalisation
    assert metrics.best_of(metrics.qa_f1, "Barack Obama", ["Obama", "Barack Obama", "president"]) == 1.0
    with pytest.raises(ValueError):
        metrics.best_of(metrics.qa_f1, "x", [])


# --------------------------------------------------------------------------- ROUGE-L

def test_lcs():
    assert metrics.lcs("ABCBDAB", "BDCABA") == list("BDAB")        # one of the LCSs: ties move left
    assert metrics.lcs_length("ABCBDAB", "BDCABA") == 4
    assert metrics.lcs([], ["a"]) == [] and metrics.lcs_length("", "abc") == 0


def test_rouge_l_hand_computed():
    f = metrics.rouge_l
    assert f("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert f("a b c d", "a c d e") == pytest.approx(0.75)               # LCS a c d: P = R = 3/4
    assert f("a b c", "a x b y c z") == pytest.approx(2 / 3)            # P 3/3, R 3/6
    # summary level: the union of sentence-pair LCSs, not one LCS of the whole texts (which is 2 of 4)
    assert f("a b. c d", "c d. a b") == pytest.approx(1.0)
    assert f("the cat sat. on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # each word counted once (the rouge package's default), so repetition is not rewarded or punished
    assert f("a a b", "a b") == pytest.approx(1.0)
    assert f("x x x x a", "a b") == pytest.approx(2 * 0.5 * 0.5 / 1.0)  # P 1/2 (x, a), R 1/2
    # case-sensitive, punctuation other than '.' stays part of the word
    assert f("A B", "a b") == 0.0
    assert f("a, b", "a b") == pytest.approx(0.5)                       # "a," != "a": LCS {b}
    # empty prediction or reference: 0 (LongBench catches the package's error and scores 0)
    assert f("", "a b") == 0.0 and f(".", "a b") == 0.0 and f("a", ".") == 0.0


def test_rouge_l_tie_break_and_empty_sentence_words():
    """Cases where the conventions matter, checked against the `rouge` package during development.
    'cat c e c' vs 'g a e cat the g' has two LCSs of length 1 (cat, e); the backtrack that moves
    left on ties picks e, which the second sentence also yields: union {e, sat}, 2 of 8 distinct
    prediction words and 2 of 5 reference words."""
    value = metrics.rouge_l(". g a e cat the g . , e the f sat", "cat c e c . b sat")
    assert value == pytest.approx(2 * (2 / 8) * (2 / 5) / (2 / 8 + 2 / 5))
    assert value == pytest.approx(0.3076923029585799)
    # a piece of only spaces between two dots is a sentence holding the word "": here in both texts
    assert metrics.rouge_l("a . . b", "a . . c") == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- classification, retrieval, count, code

def test_classification():
    classes = ["Location", "Entity", "Abbreviation", "Human being", "Numeric value", "Value", "Description"]
    c = metrics.classification
    assert c("Entity", "Entity", all_classes=classes) == 1.0
    assert c("Entity or Location", "Entity", all_classes=classes) == 0.5
    assert c("Location", "Entity", all_classes=classes) == 0.0
    # "Value" is part of the true class "Numeric value": not counted as a second answer
    assert c("Numeric value", "Numeric value", all_classes=classes) == 1.0
    with pytest.raises(ValueError):
        c("Entity", "Entity")


def test_retrieval_and_count():
    assert metrics.retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert metrics.retrieval("Paragraph 12, or maybe Paragraph 3", "Paragraph 12") == 0.5
    assert metrics.retrieval("Paragraph 1", "Paragraph 12") == 0.0
    assert metrics.retrieval("I don't know", "Paragraph 12") == 0.0
    assert metrics.count("There are 7 unique paragraphs out of 10.", "7") == 0.5
    assert metrics.count("7", 7) == 1.0
    assert metrics.count("seven", "7") == 0.0


def test_code_sim():
    # kitten/sitting: LCS "ittn" (4 of 6 + 7 characters): round(100 * 8 / 13) = 62
    assert metrics.edit_ratio("kitten", "sitting") == pytest.approx(8 / 13)
    assert metrics.code_sim("kitten", "sitting") == 0.62
    assert metrics.edit_ratio("", "") == 1.0 and metrics.edit_ratio("", "abc") == 0.0
    # the first line that is not a comment or a code fence is scored
    assert metrics.code_sim("\n```python\n# set x\nx = 1\ny = 2\n", "x = 1") == 1.0
    assert metrics.code_sim("// only comments", "x = 1") == 0.0


def test_ruler_string_match():
    refs = ["123", "456", "789"]
    assert metrics.string_match_all("The keys are 123 and 456.", refs) == pytest.approx(2 / 3)
    assert metrics.string_match_part("The keys are 123 and 456.", refs) == 1.0
    assert metrics.string_match_part("none", refs) == 0.0
    assert metrics.string_match_all("PARIS and Rome", ["paris", "rome"]) == 1.0          # case-insensitive
    assert metrics.ruler_postprocess("  a\x01b\x1f \n") == "a\nb"


# --------------------------------------------------------------------------- LongBench settings and truncation

def test_longbench_task_table():
    tasks = longbench.load_tasks()
    assert sorted(tasks) == sorted([
        "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
        "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"])
    assert {n for n, t in tasks.items() if not t["chat"]} == {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}
    assert {n for n, t in tasks.items() if t["first_line"]} == {"trec", "triviaqa", "samsum"}
    assert {n: t["max_new_tokens"] for n, t in tasks.items()} == {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
        "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
        "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64}
    for name, t in tasks.items():
        assert "{context}" in t["prompt"] and t["metric"] in metrics.METRICS, name
        t["prompt"].format(context="C", input="I")                          # no stray format fields
    assert longbench.Task.named("hotpotqa_e").name == "hotpotqa"             # LongBench-E files
    with pytest.raises(longbench.UsageError, match="unknown LongBench task"):
        longbench.Task.named("nope")
    json.loads(longbench.TASKS_FILE.read_text())


def test_scoring_uses_first_line_only_where_longbench_does():
    row = {"answers": ["Paris"], "all_classes": None}
    assert longbench.score(longbench.Task.named("triviaqa"), "\nParis\nLondon London", row) == 1.0
    assert longbench.score(longbench.Task.named("hotpotqa"), "Paris\nLondon", row) == pytest.approx(2 / 3)


def test_truncate_middle_keeps_head_and_tail():
    ids = list(range(10))
    assert prompts.truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert prompts.truncate_middle(ids, 5) == [0, 1, 2, 8, 9]               # odd budget: one more from the head
    assert prompts.truncate_middle(ids, 1) == [0]
    assert prompts.truncate_middle(ids, 0) == []
    assert prompts.truncate_middle(ids, 10) == ids and prompts.truncate_middle(ids, 50) == ids
    with pytest.raises(ValueError):
        prompts.truncate_middle(ids, -1)
