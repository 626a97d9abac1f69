"""Looking a name up in one of the algorithm registries, with an error that names the closest entry."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["lookup", "register"]

Entry = TypeVar("Entry")


def lookup(registry: Mapping[str, Entry], name: str, kind: str) -> Entry:
    """``registry[name]``; an unknown name raises ValueError listing the entries and the closest match."""
    try:
        return registry[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(registry), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {kind} {name!r}{hint} (registered: {', '.join(registry)})") from None


def register(registry: dict[str, Entry], name: str, kind: str, protocol: type):
    """Decorator adding a user's function to ``registry`` under ``name``, after checking that it can be called
    the way the trainer calls every entry: with the keyword arguments of ``protocol.__call__``."""

    def decorator(fn):
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered; pick another name")
        expected = [p for p in inspect.signature(protocol.__call__).parameters if p != "self"]
        params = inspect.signature(fn).parameters.values()
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            accepted = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
            missing = [p for p in expected if p not in accepted]
            if missing:
                raise TypeError(
                    f"{kind} {name!r} ({fn.__name__}) does not accept {', '.join(missing)}; every {kind} is called "
                    f"with the keyword arguments {', '.join(expected)} (add **kwargs to ignore the ones it does not use)"
                )
        required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        unknown = [p for p in required if p not in expected]
        if unknown:
            raise TypeError(f"{kind} {name!r} ({fn.__name__}) requires {', '.join(unknown)}, which the trainer never passes")
        registry[name] = fn
        return fn

    return decorator
