"""docs/adding-a-policy.md stays true to the code: its worked example is the real cache/knorm.py (a copy of
an example that drifted lost decode_evict and the n_recent check), and the modules it names exist."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "adding-a-policy.md"


def worked_example(text: str) -> str:
    """The first python code block of the guide's section 2."""
    section = text[text.index("## 2. "):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "section 2 of the guide has no python code block"
    return match.group(1).strip("\n")


def code_below_docstring(path: Path) -> str:
    """A module's source after its module docstring."""
    source = path.read_text()
    docstring = ast.parse(source).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), f"{path} has no docstring"
    return "\n".join(source.splitlines()[docstring.end_lineno:]).strip("\n")


def test_the_worked_example_is_cache_knorm():
    example, real = worked_example(GUIDE.read_text()), code_below_docstring(ROOT / "cache" / "knorm.py")
    assert example == real, "docs/adding-a-policy.md section 2 differs from cache/knorm.py below its docstring"


def test_the_guide_names_existing_modules():
    named = set(re.findall(r"\b((?:cache|tests|eval|docs|scripts|runtime)/[\w/]+\.(?:py|md))", GUIDE.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert named and not missing, f"the guide names missing files: {missing}"
