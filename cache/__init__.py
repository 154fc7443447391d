"""KV-cache policies: the registry behind `--policy NAME --policy-args k=v,...`.

Every policy follows the contract documented on `model.DenseCache` (the `full` policy) and
declares its hyper-parameters in a `params` dict: name -> (type, default, help).
"""
from __future__ import annotations

from model import DenseCache
from cache.d2o import D2OPolicy
from cache.h2o import H2OPolicy
from cache.pyramidkv import PyramidKVPolicy
from cache.simlayerkv import SimLayerKVPolicy
from cache.snapkv import SnapKVPolicy
from cache.streaming import StreamingPolicy


class PolicyError(ValueError):
    """Unknown policy or malformed/unknown policy arguments."""


POLICIES: dict[str, type] = {cls.name: cls for cls in (
    DenseCache, StreamingPolicy, H2OPolicy, SnapKVPolicy, PyramidKVPolicy, D2OPolicy, SimLayerKVPolicy)}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def parse_policy_args(text: str) -> dict[str, str]:
    """'k=v,k2=v2' -> {'k': 'v', 'k2': 'v2'} (values still strings)."""
    out = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise PolicyError(f"malformed --policy-args item {item!r}: expected key=value")
        if key.strip() in out:
            raise PolicyError(f"--policy-args sets {key.strip()!r} twice")
        out[key.strip()] = value.strip()
    return out


def _convert(name: str, value: str, kind: type):
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return kind(value)
    except ValueError:
        raise PolicyError(f"policy argument {name}={value!r} is not a valid {kind.__name__}") from None


def make_policy(name: str, args: str | dict | None = None):
    """A policy instance from its registry name and 'k=v,...' (or dict) arguments."""
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(policy_names())}")
    cls = POLICIES[name]
    declared = getattr(cls, "params", {})
    given = parse_policy_args(args) if isinstance(args, str) or args is None else dict(args)
    unknown = sorted(set(given) - set(declared))
    if unknown:
        valid = ", ".join(f"{k} ({t.__name__}, default {d})" for k, (t, d, _) in declared.items()) or "none"
        raise PolicyError(f"policy {name!r} has no parameter(s) {', '.join(unknown)}; valid: {valid}")
    kwargs = {k: _convert(k, v, declared[k][0]) if isinstance(v, str) else v for k, v in given.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise PolicyError(f"policy {name!r}: {e}") from None
