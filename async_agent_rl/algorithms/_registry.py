"""Name -> function lookup shared by every algorithm family (advantages, losses, KL estimators)."""

from __future__ import annotations

from typing import Mapping, TypeVar

T = TypeVar("T")


class UnknownAlgorithmError(ValueError):
    """A name that no registry holds. The message lists the allowed names, in registry order."""


def lookup(registry: Mapping[str, T], name: str, family: str) -> T:
    """Return ``registry[name]``; raise ``UnknownAlgorithmError`` naming the family and the allowed names."""
    try:
        return registry[name]
    except KeyError:
        allowed = ", ".join(repr(k) for k in registry)
        raise UnknownAlgorithmError(f"unknown {family} {name!r}; allowed: {allowed}") from None
