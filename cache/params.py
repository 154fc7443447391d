"""A policy's hyper-parameters are the fields of its dataclass (kvpress's style), each made by `param`
with its help text; `policy_params` reads them and `convert` parses a spec's text into one.  This is
the one parser: the dataclass's own `__init__` takes the values, `__post_init__` checks them.

    @dataclass(eq=False)
    class MyPolicy(EvictionPolicy):
        budget: int = param(256, "tokens kept per layer and KV head")

A policy that is not a dataclass (the dense cache) takes no parameters.
"""
from __future__ import annotations

import functools
import typing
from dataclasses import field, fields, is_dataclass
from typing import Callable, Optional

from cache.spec import PolicyError


def param(default, help: str, parse: Optional[Callable] = None):
    """A policy parameter: a dataclass field with its help text and, if its type does not parse its
    spec text (e.g. '3/4'), a parser."""
    return field(default=default, metadata={"help": help, "parse": parse})


@functools.cache
def policy_params(cls: type) -> dict[str, tuple[Callable, object, str]]:
    """name -> (parser, default, help) for every `param` field of a policy class ({} for none)."""
    if not is_dataclass(cls):
        return {}
    hints = typing.get_type_hints(cls)
    return {f.name: (f.metadata["parse"] or hints[f.name], f.default, f.metadata["help"])
            for f in fields(cls) if "help" in f.metadata}


def param_values(policy) -> dict:
    """The policy's parameters and their current values (for describe())."""
    return {k: getattr(policy, k) for k in policy_params(type(policy))}


def convert(name: str, value: str, kind: Callable):
    """A spec's text for parameter `name` as its type (bools: true/false/1/0)."""
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return kind(value)
    except ValueError:
        raise PolicyError(f"policy argument {name}={value!r} is not a valid {getattr(kind, '__name__', 'value')}") \
            from None
