"""One registry helper for every family chosen by name: eviction policies, tier kinds, copy engines.

A :class:`Registry` maps a short name to a lazily imported class (``"module:Class"``, imported
on first use, so naming the registry costs nothing) and also loads a class from outside kvtier:
a class path in the name itself (``my_pkg.tiers:RemoteTierConfig``), or a class name with a
module path beside it (``eviction: MyPolicy`` with ``eviction_module_path: my_pkg.policies``).
Every failure is a :class:`~kvtier.errors.ConfigError` naming the field, the registered names
and the fix.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Generic, TypeVar, cast

from kvtier.errors import ConfigError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of ``what`` (e.g. ``"eviction policy"``) mapped to subclasses of ``base``.

    ``module_key`` is the configuration key that names an out-of-tree module for this family
    (``eviction_module_path``, ``module_path``); it only shapes error messages. Any thread;
    :meth:`resolve` imports, so call it where configuration is parsed or objects are built.
    """

    # ``base`` is typed ``type`` rather than ``type[T]``: it is usually abstract, and is only
    # used for the issubclass check (T comes from the annotated registry variable).
    def __init__(self, what: str, base: type, entries: Mapping[str, str], module_key: str):
        self.what = what
        self.base = base
        self.module_key = module_key
        self._entries = dict(entries)

    def names(self) -> tuple[str, ...]:
        """The registered short names, in registration order."""
        return tuple(self._entries)

    def register(self, name: str, target: str) -> None:
        """Add (or replace) ``name`` -> ``"module:Class"``; for packages that ship their own."""
        if ":" not in target:
            raise ValueError(f"a {self.what} target is 'module:Class', got {target!r}")
        self._entries[name] = target

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    @staticmethod
    def is_class_path(name: object) -> bool:
        """Whether ``name`` is written as ``module:Class`` (an out-of-tree class by path)."""
        return isinstance(name, str) and name.count(":") == 1 and all(name.split(":"))

    def resolve(self, name: str, module_path: str | None = None, *, field: str) -> type[T]:
        """The class for ``name``: registered, ``module:Class``, or class ``name`` of ``module_path``.

        ``field`` is where ``name`` was written (``tiers[1].kind``); errors name it, or the
        module key beside it when the module is what is wrong.
        """
        module_field = field.rsplit(".", 1)[0] + "." + self.module_key if "." in field else self.module_key
        if module_path is not None:
            return self._load(module_path, name, field, module_field, name)
        if self.is_class_path(name):
            module_name, class_name = name.split(":")
            return self._load(module_name, class_name, field, field, name)
        target = self._entries.get(name)
        if target is None:
            raise ConfigError(
                field,
                name,
                f"a {self.what}: one of {', '.join(self._entries)}, or a class path 'module:Class'",
                f"pick a registered name, or name your own class as module:Class (or set {self.module_key})",
            )
        module_name, class_name = target.split(":")
        return self._load(module_name, class_name, field, field, name)

    def _load(self, module_name: str, class_name: str, field: str, module_field: str, value: str) -> type[T]:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                module_field, module_name, "an importable module", f"check the module name ({exc})"
            ) from exc
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ConfigError(
                field,
                value,
                f"the name of a {self.base.__module__}.{self.base.__qualname__} subclass "
                f"defined in {module_name}",
                f"subclass {self.base.__qualname__} and name that class here",
            )
        return cast("type[T]", cls)  # a subclass of base, checked just above
