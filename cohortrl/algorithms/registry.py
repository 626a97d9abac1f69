"""Looking a name up in one of the algorithm registries, with an error that names the closest entry."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["lookup"]

Entry = TypeVar("Entry")


def lookup(registry: Mapping[str, Entry], name: str, kind: str) -> Entry:
    """``registry[name]``; an unknown name raises ValueError listing the entries and the closest match."""
    try:
        return registry[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(registry), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {kind} {name!r}{hint} (registered: {', '.join(registry)})") from None
