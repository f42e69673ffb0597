"""One small generic registry.

The key a method registers under is the same string on the command line, in recipe YAML and in
file metadata (STYLE.md). Registering a name twice raises.
"""

from __future__ import annotations

import difflib
from typing import Generic, TypeVar

from compress.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object map that refuses duplicates and suggests the closest name on a miss.

    Args:
        kind: what the entries are, for error messages ("transform", "format").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        """Add ``item`` under ``name``. Raises ValueError if the name is taken."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        """Return the entry for ``name``; raises ConfigError listing valid names and the closest match."""
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._items), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown {self.kind} {name!r} (valid: {', '.join(sorted(self._items)) or 'none'}){hint}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
