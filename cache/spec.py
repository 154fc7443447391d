"""The one policy-spec syntax every command takes.

    SPEC  =  NAME[@LABEL][:KEY=VALUE,...]        e.g.  snapkv:budget=128,obs_window=16
    NAME  =  POLICY  |  STORAGE+READER           e.g.  snapkv+hshare:budget=1024,preset=short
    LIST  =  SPEC[;SPEC...]                      e.g.  'full; snapkv:budget=128; hshare@half:ratios=1/2-1/2-1/2'

A comma separates a spec's arguments, so a list of specs uses `;` (or the flag repeated:
`--policies full --policies snapkv:budget=128`).  `@LABEL` names a variant, so one run can hold the
same policy with other arguments (the benchmark and the eval suite report it; a policy ignores it).
`engine.py --policy snapkv --policy-args budget=128` is another spelling of
`--policy snapkv:budget=128`: `with_args` merges the two (a key given twice is an error).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


class PolicyError(ValueError):
    """Unknown policy, malformed spec, or unknown/ill-typed policy arguments."""


@dataclass(frozen=True)
class PolicySpec:
    name: str                                   # registry name, or STORAGE+READER
    label: str = ""                             # @LABEL, or ""
    args: tuple[tuple[str, str], ...] = field(default=())   # (key, value) as written, in order

    @property
    def arg_dict(self) -> dict[str, str]:
        return dict(self.args)

    @property
    def arg_text(self) -> str:
        """'k=v,k2=v2' (what --policy-args used to take)."""
        return ",".join(f"{k}={v}" for k, v in self.args)

    @property
    def variant(self) -> str:
        """NAME@LABEL (or NAME): tells the specs of one run apart."""
        return self.name + (f"@{self.label}" if self.label else "")

    def __str__(self) -> str:
        return self.variant + (f":{self.arg_text}" if self.args else "")

    def with_args(self, text: str | dict | None) -> "PolicySpec":
        """This spec with more arguments ('k=v,...' or a dict); a key it already has is an error."""
        extra = parse_args(text) if isinstance(text, str) or text is None else {k: str(v) for k, v in text.items()}
        twice = sorted(set(extra) & set(self.arg_dict))
        if twice:
            raise PolicyError(f"policy argument(s) {', '.join(twice)} given twice (in {str(self)!r} and again)")
        return PolicySpec(self.name, self.label, self.args + tuple(extra.items()))


def parse_args(text: str | None) -> dict[str, str]:
    """'k=v,k2=v2' -> {'k': 'v', 'k2': 'v2'} (values still strings)."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise PolicyError(f"malformed policy argument {item!r}: expected key=value")
        if key in out:
            raise PolicyError(f"policy argument {key!r} given twice")
        out[key] = value
    return out


NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")     # a registered policy's name


def parse_spec(text: str) -> PolicySpec:
    """'NAME[@LABEL][:k=v,...]' -> PolicySpec (names are checked against the registry by make_policy)."""
    if ";" in text:
        raise PolicyError(f"{text!r} holds several specs: give one, or use a list flag (';' separates specs)")
    head, colon, rest = text.strip().partition(":")
    if colon and not rest.strip():
        raise PolicyError(f"malformed policy spec {text!r}: nothing after ':'")
    args = parse_args(rest)
    if "," in head or any(":" in key or "@" in key for key in args):
        raise PolicyError(f"{text.strip()!r} is not one spec: separate specs with ';' or repeat the flag "
                          f"(a comma separates one spec's arguments: NAME[@LABEL]:k=v,k=v)")
    name, at, label = head.partition("@")
    parts, label = [part.strip() for part in name.split("+")], label.strip()
    if not all(NAME.fullmatch(part) for part in parts) or (at and not label):
        raise PolicyError(f"malformed policy spec {text!r}: expected NAME[@LABEL][:key=value,...]")
    return PolicySpec("+".join(parts), label, tuple(args.items()))


def parse_spec_list(texts: str | list[str]) -> list[PolicySpec]:
    """Specs from ';'-separated text, or from the values of a repeated flag (each may hold ';' too).
    Two specs with the same NAME@LABEL are an error (give a variant its own @LABEL)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    specs = [parse_spec(t) for text in texts for t in text.split(";") if t.strip()]
    if not specs:
        raise PolicyError("no policy spec given")
    seen = set()
    for s in specs:
        if s.variant in seen:
            raise PolicyError(f"{s.variant!r} is listed twice: give each variant its own @LABEL "
                            f"(e.g. {s.name}@a:... ; {s.name}@b:...)")
        seen.add(s.variant)
    return specs
