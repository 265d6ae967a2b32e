"""One plug-in mechanism: a registry of subclasses by name.

A kind of plug-in (extractors, question generators, chunkers, KV codecs, RoPE types, runners) is
a base class deriving :class:`Registered` whose ``registry`` is a :class:`Registry`; a plug-in is
a subclass declared with its name, which registers it::

    class Extractor(Registered):
        registry = Registry("extractor", EXTRACTORS, modules={...})

    class RulesExtractor(Extractor, name="rules"): ...

    Extractor.registry["rules"]  # -> RulesExtractor
    Extractor.registry["nope"]   # UnknownPlugin: "unknown extractor 'nope' (local, none, ...)"

``names`` are the names the settings allow (``schemas/settings.py`` declares them, so the CLI
checks a value before anything loads); ``modules`` maps a name to the module defining it, imported
on the first look-up, so a process imports only the plug-ins it uses (the ``openai`` client, a
local model). ``in`` imports nothing; iterating imports every declared plug-in. A kind whose
plug-ins answer for a stage (extractors, question generators) derives :class:`Backend`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from importlib import import_module
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")


class UnknownPlugin(ValueError):
    """No plug-in of that kind is registered under that name (the message lists the known)."""


class Registry(Mapping[str, type[T]], Generic[T]):
    """``name -> subclass`` of one kind of plug-in, filled by subclassing :class:`Registered`.

    ``kind`` names the plug-in in messages ("extractor", "KV codec"); ``names``: the declared
    names (listed in that order, then any other registered); ``modules``: ``name -> module``
    (dotted) imported when ``name`` is first looked up and not yet registered.
    """

    def __init__(
        self, kind: str, names: Sequence[str] = (), modules: Mapping[str, str] | None = None
    ) -> None:
        self.kind = kind
        self._names = tuple(names)
        self._modules = dict(modules or {})
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str, cls: type[T]) -> None:
        """Add ``cls`` as ``name`` (ValueError when another class has that name)."""
        old = self._classes.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"two {self.kind}s named {name!r}: {old.__name__}, {cls.__name__}")
        self._classes[name] = cls

    def __delitem__(self, name: str) -> None:  # a probe subclass of a test, unregistered
        del self._classes[name]

    def known(self) -> list[str]:
        """Every name, declared first (without importing anything)."""
        return [*self._names, *(n for n in self._classes if n not in self._names)]

    def __getitem__(self, name: str) -> type[T]:
        if name not in self._classes and name in self._modules:
            import_module(self._modules[name])
        try:
            return self._classes[name]
        except KeyError:
            raise UnknownPlugin(
                f"unknown {self.kind} {name!r} ({', '.join(sorted(self.known()))})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._classes or name in self._names

    def __iter__(self) -> Iterator[str]:
        for name in self._names:
            self[name]
        return iter(dict(self._classes))

    def __len__(self) -> int:
        return len(list(iter(self)))


class Registered:
    """Base of a plug-in kind: a subclass declared ``class X(Base, name="x")`` is registered in
    ``Base.registry`` as ``"x"``, and its ``name`` (and the attribute ``name_attr`` names, e.g.
    an extractor's ``backend``) is set to it. A subclass without ``name`` is abstract."""

    registry: ClassVar[Registry[Any]]
    name: ClassVar[str] = ""
    name_attr: ClassVar[str] = "name"

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
            setattr(cls, cls.name_attr, name)
            cls.registry.register(name, cls)


class Backend(Registered):
    """Base of a kind of plug-in that answers for a stage from a model or rules (the nugget
    extractors, the question generators): registered under its ``backend`` name, asking
    ``llm_model`` (the model its ledger rows name), and fingerprinted."""

    name_attr: ClassVar[str] = "backend"
    backend: ClassVar[str]
    llm_model: str

    @property
    def fingerprint(self) -> str:
        """``keys.fingerprint`` of everything the answers depend on (no secrets: no key, no
        URL)."""
        raise NotImplementedError
