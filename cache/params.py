"""A policy's hyper-parameters are the fields of its dataclass (kvpress's style), each made by `param`
with its help text; `policy_params` reads them and `convert` parses a spec's text into one.  This is
the one parser: the dataclass's own `__init__` takes the values, `__post_init__` checks them.

    @dataclass(eq=False)
    class MyPolicy(EvictionPolicy):
        budget: int = param(256, "tokens kept per layer and KV head")

A policy that is not a dataclass (the dense cache) takes no parameters.

The parameter groups the eviction family shares (each a dataclass a policy lists among its bases, or a
field maker): Budget (budget or ratio), HeadAgg (head_agg), DecodeEviction (decode_evict), and
sink_param / recent_param (n_sink, n_recent: the sinks and the recent window, always kept).
"""
from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field, fields, is_dataclass
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


# --------------------------------------------------------------------------- the eviction family's groups

HEAD_AGG = ("mean", "max", "query")     # the values head_agg may take


def sink_param(default: int):
    """The n_sink parameter of the base's sinks-and-recent-window option, with a policy's default."""
    return param(default, "first tokens of the sequence, always kept (attention sinks)")


def recent_param(default: int, help: str = "most recent tokens, always kept (in decode the new token is one)"):
    """The n_recent parameter of the same option (EvictionPolicy.recent_window), with a policy's default."""
    return param(default, help)


@dataclass(eq=False)
class HeadAgg:
    """Parameter of the policies and readers that reduce a KV head's query heads to one score per token."""
    head_agg: str = param("mean", "how a KV head's query heads score a token: mean, max (per query), "
                                  "or query (each query head keeps its own tokens: G x the KV memory)")


@dataclass(eq=False)
class DecodeEviction:
    """Parameter of the policies whose layers evict during decode (memory flat): `decode_evict=false` makes
    them compress at prefill only and append every decode token, as kvpress's presses do (memory then
    grows with the question and the answer, as an appending policy's)."""
    decode_evict: bool = param(True, "evict a kept token for each decode token, so memory stays flat (false: "
                                     "compress at prefill only and append decode tokens, as kvpress)")


DEFAULT_BUDGET = 256      # tokens per layer and KV head when neither budget nor ratio is given


@dataclass(eq=False)
class Budget:
    """Parameters of the policies that keep a token budget per layer and KV head: `budget` (tokens) or
    `ratio` (the share of each prompt removed), not both; neither: budget=DEFAULT_BUDGET.  A ratio resolves
    per request and per row (`EvictionPolicy.resolve_budget`)."""
    budget: Optional[int] = param(None, f"tokens kept per layer and KV head, window included ({DEFAULT_BUDGET} "
                                        f"when ratio is not given)", parse=int)
    ratio: Optional[float] = param(None, "instead of budget: the share of a prompt's tokens removed, in (0, 1) "
                                         "(kvpress's compression_ratio): a prompt of n tokens keeps "
                                         "int(n * (1 - ratio)) per layer and KV head", parse=float)
