"""KV-cache policies: the registry behind `--policy NAME[:k=v,...]` (spec syntax: cache/spec.py).

Every policy follows the contract of cache/contract.py (its one description); its hyper-parameters
are the fields of its dataclass, each with help text (cache/params.py).

Composition: `--policy STORAGE+READER` puts a sparse reader (ds, quest, hshare: it replaces decode
attention) on top of a storage policy (full or an eviction policy: it decides what is kept), e.g.
`--policy snapkv+hshare:budget=1024,preset=short`.  Each argument goes to the policy
that declares it; a name both declare must be prefixed (`streaming+hshare:streaming.n_sink=4,hshare.n_sink=8`).
A reader alone (`hshare`) reads the full cache.
"""
from __future__ import annotations

from cache.contract import contract_members
from cache.d2o import D2OPolicy
from cache.full import FullCache
from cache.ds import DSPolicy
from cache.h2o import H2OPolicy
from cache.hshare import HSharePolicy
from cache.knorm import KnormPolicy
from cache.pod import PODPolicy
from cache.pyramidkv import PyramidKVPolicy
from cache.quest import QuestPolicy
from cache.simlayerkv import SimLayerKVPolicy
from cache.snapkv import SnapKVPolicy
from cache.params import convert, policy_params
from cache.spec import PolicyError, PolicySpec, parse_spec, parse_spec_list
from cache.streaming import StreamingPolicy
from cache.tova import TOVAPolicy


POLICIES: dict[str, type] = {}


def register(cls: type) -> type:
    """Add a policy class (it follows cache/contract.py) under `cls.name`; usable as a decorator.  A
    registered policy is reachable from every command's spec and joins tests/test_policy_matrix.py."""
    missing = [m for m in contract_members() if m not in dir(cls)]
    if missing:
        raise TypeError(f"{cls.__name__} does not declare {', '.join(missing)} (the CachePolicy members of "
                        f"cache/contract.py)")
    if cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise ValueError(f"a policy named {cls.name!r} is already registered ({POLICIES[cls.name].__name__})")
    POLICIES[cls.name] = cls
    return cls


for _cls in (FullCache, StreamingPolicy, H2OPolicy, SnapKVPolicy, PyramidKVPolicy, D2OPolicy, SimLayerKVPolicy,
             TOVAPolicy, KnormPolicy, DSPolicy, QuestPolicy, HSharePolicy, PODPolicy):
    register(_cls)


def policy_names() -> list[str]:
    return sorted(POLICIES)


def is_sparse_reader(name: str) -> bool:
    return name in POLICIES and POLICIES[name].is_sparse_reader


def _build(name: str, given: dict, inner=None):
    cls = POLICIES[name]
    declared = policy_params(cls)
    old = sorted(set(given) & set(cls.renamed))
    if old:
        raise PolicyError(f"policy {name!r}: " + "; ".join(f"parameter {k!r} is now {cls.renamed[k]!r}" for k in old))
    unknown = sorted(set(given) - set(declared))
    if unknown:
        valid = ", ".join(f"{k} ({t.__name__}, default {d})" for k, (t, d, _) in declared.items()) or "none"
        raise PolicyError(f"policy {name!r} has no parameter(s) {', '.join(unknown)}; valid: {valid}")
    kwargs = {k: convert(k, v, declared[k][0]) if isinstance(v, str) else v for k, v in given.items()}
    if inner is not None:
        kwargs["inner"] = inner
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise PolicyError(f"policy {name!r}: {e}") from None


def _route(names: list[str], given: dict) -> dict[str, dict]:
    """Send each argument to the policy (of `names`) that declares it; 'name.key' picks one."""
    routed: dict[str, dict] = {n: {} for n in names}
    for key, value in given.items():
        prefix, dot, bare = key.partition(".")
        if dot:
            if prefix not in routed:
                raise PolicyError(f"argument {key!r}: {prefix!r} is not one of {' + '.join(names)}")
            routed[prefix][bare] = value
            continue
        owners = [n for n in names if key in policy_params(POLICIES[n]) or key in POLICIES[n].renamed]
        if len(owners) > 1:
            raise PolicyError(f"argument {key!r} is a parameter of both {owners[0]} and {owners[1]}: "
                              f"write {owners[0]}.{key}=... or {owners[1]}.{key}=...")
        routed[owners[0] if owners else names[-1]][key] = value   # unknown keys: reported by _build
    return routed


def make_policy(spec: "str | PolicySpec", args: "str | dict | None" = None):
    """A policy instance from a spec ('snapkv:budget=128', 'snapkv+hshare:preset=short', or a
    PolicySpec) plus optional extra arguments ('k=v,...' or a dict: `--policy-args`)."""
    spec = spec if isinstance(spec, PolicySpec) else parse_spec(spec)
    given = spec.with_args(args).arg_dict if args else spec.arg_dict
    names = spec.name.split("+")
    unknown = [n for n in names if n not in POLICIES]
    if unknown or len(names) > 2:
        raise PolicyError(f"unknown policy {spec.name!r}; available: {', '.join(policy_names())} "
                          f"(or STORAGE+READER, e.g. snapkv+hshare)")
    routed = _route(names, given)
    if len(names) == 1:
        return _build(spec.name, routed[spec.name])
    storage, reader = names
    if not is_sparse_reader(reader) or is_sparse_reader(storage):
        readers = ", ".join(n for n in policy_names() if is_sparse_reader(n))
        raise PolicyError(f"cannot compose {spec.name!r}: write STORAGE+READER with a sparse reader ({readers}) "
                          f"after a storage policy (full or an eviction policy)")
    if storage == reader:
        raise PolicyError(f"cannot compose {spec.name!r} with itself")
    return _build(reader, routed[reader], inner=_build(storage, routed[storage]))
