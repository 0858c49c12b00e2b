"""Things of one kind by name: compressors, exchanges, task families, models.

One mechanism for every name a config can give: a :class:`Registry` is a read-only mapping from names to
classes or builders, filled by ``@REGISTRY.register`` (the name from the class's ``name`` attribute) or
``REGISTRY.add(name, obj)``, and :meth:`Registry.pick` fails with one line listing the valid names. An entry
can also be ``"module:attribute"`` (:meth:`Registry.lazy`), imported on first use, for families whose modules
are heavy to import (the tasks import their data and model code).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Named entries of one ``kind`` (a word for error messages: ``"compressor"``, ``"exchange"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._lazy: set[str] = set()

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` as ``name``; a second, different entry of the same name is an error."""
        if name in self._entries and self._entries[name] is not obj and name not in self._lazy:
            raise TypeError(f"two {self.kind}s are named {name!r}")
        self._entries[name] = obj
        self._lazy.discard(name)
        return obj

    def register(self, obj: T) -> T:
        """Class decorator: register ``obj`` under its ``name`` attribute."""
        return self.add(obj.name, obj)  # type: ignore[attr-defined]

    def lazy(self, name: str, target: str) -> None:
        """Register ``"module:attribute"``, imported when ``name`` is first looked up."""
        self._entries[name] = target
        self._lazy.add(name)

    def pick(self, name: str) -> T:
        """The entry ``name``; an unknown name raises a ValueError listing the valid ones."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self._entries)}")
        return self[name]

    def __getitem__(self, name: str) -> T:
        if name in self._lazy:
            module, attr = self._entries[name].split(":")
            self.add(name, getattr(importlib.import_module(module), attr))
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
