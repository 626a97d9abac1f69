"""The algorithm registries: one table per kind (estimators, policy losses), each entry a function together
with what it declared it needs from the run, and a lookup whose error names the closest entry."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Entry", "Registry", "lookup", "register"]


@dataclass(frozen=True)
class Entry:
    """One registered name: the function the trainer calls and what it needs from the run (the registry's
    ``needs`` type, e.g. `EstimatorNeeds`), which the config is checked against."""

    fn: Callable
    needs: Any


class Registry(dict):
    """``name -> Entry`` for one kind. Every way into the table checks the value, so no entry lacks what it
    needs: a bare function put in by hand is refused, not given a default."""

    def __init__(self, kind: str, needs_type: type, how: str, entries: Mapping[str, Entry] = ()):
        super().__init__()
        self.kind, self.needs_type, self.how = kind, needs_type, how
        self.update(entries)

    def __setitem__(self, name: str, entry: Entry) -> None:
        if not (isinstance(entry, Entry) and isinstance(entry.needs, self.needs_type)):
            raise TypeError(
                f"{self.kind} {name!r}: a registry entry is Entry(fn, {self.needs_type.__name__}(...)), not a "
                f"{type(entry).__name__}; add it with {self.how}, which declares what it needs"
            )
        super().__setitem__(name, entry)

    def update(self, *args, **kwargs) -> None:
        for name, entry in dict(*args, **kwargs).items():
            self[name] = entry

    def setdefault(self, name: str, entry: Entry | None = None) -> Entry:
        if name not in self:
            self[name] = entry
        return self[name]

    def __ior__(self, other):
        self.update(other)
        return self


def lookup(registry: Registry, name: str) -> Entry:
    """``registry[name]``; an unknown name raises ValueError listing the entries and the closest match."""
    try:
        return registry[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(registry), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {registry.kind} {name!r}{hint} (registered: {', '.join(registry)})") from None


def register(registry: Registry, name: str, protocol: type, needs: Any):
    """Decorator entering a user's function in ``registry`` under ``name`` with what it ``needs``, after checking
    that it can be called the way the trainer calls every entry: with the keyword arguments of
    ``protocol.__call__``."""
    kind = registry.kind

    def decorator(fn):
        if name in registry and registry[name].fn is not fn:
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
        registry[name] = Entry(fn, needs)
        return fn

    return decorator
