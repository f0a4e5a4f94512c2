"""Names to implementations, each name registered once: how the library selects a draft kind,
a proposer method or a draft name by its name rather than by an if/else ladder.

Kept apart from any implementation (no torch here), so the params schema can hold one too.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(LookupError):
    """A name no implementation is registered under; the caller says where it came from."""


class Registry(Generic[T]):
    """Names to implementations, each name registered once, kept in registration order."""

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        # Two owners of one name would make the winner depend on import order.
        if name in self._items:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._items[name] = item
        return item

    def remove(self, name: str) -> None:
        """Undo a registration (a test's own kind, once the test is done)."""
        self.get(name)
        del self._items[name]

    def get(self, name: str) -> T:
        if name not in self._items:
            known = ", ".join(repr(n) for n in self._items)
            raise UnknownName(f"unknown {self.what} {name!r} (known: {known})")
        return self._items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def values(self) -> tuple[T, ...]:
        return tuple(self._items.values())
