"""Typer options generated from a settings dataclass: declared once in ``schemas/settings.py``.

Every field declared with ``setting(..., cli=True)`` becomes an option of each command
decorated with :func:`with_settings_options`: ``--field-name`` (or the field's ``flag``), typed
as the field, default ``None`` ("not given": the config file's value, else the field's
default), its help text from the declaration (``{default}`` filled in), grouped under one help
panel. A ``bool`` field becomes an on-only flag when its default is False (``--prune``) and a
``--x/--no-x`` pair otherwise. The command receives the options it was given as one dict,
``overrides`` (``{name: value or None}``), for ``schemas.settings.load_settings``; so ``build``
and ``serve`` take the same settings by construction, and a new setting needs only its
declaration.

Mechanics: Typer reads a command's parameters from ``inspect.signature(fn, eval_str=True)``,
which honours ``__signature__``; the wrapper's signature is the command's own (string
annotations resolved, since ``from __future__ import annotations`` is on) without
``overrides``, plus the generated keyword-only options.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from coinrag.schemas.settings import check_choices, cli_settings

PANEL = "Build settings"


def _option_type(hint: Any) -> Any:
    """``str | None`` -> ``str``: the type the option parses (``None`` means "not given")."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _flag(field: dataclasses.Field, base: Any) -> str:
    name = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
    if base is bool and field.default is not False and "/" not in name:
        name = f"{name}/--no-{name.removeprefix('--')}"
    return name


def _option(field: dataclasses.Field, base: Any, panel: str | None, help: str | None) -> Any:
    text = help if help is not None else str(field.metadata.get("help", ""))
    return typer.Option(
        _flag(field, base),
        help=text.format(default=field.default),
        rich_help_panel=panel,
        min=field.metadata.get("min"),
    )


def settings_parameters(
    cls: type, panel: str | None = PANEL, *, defaults: bool = False
) -> list[inspect.Parameter]:
    """One keyword-only parameter per ``cli=True`` field of ``cls``: default None ("not given")
    and typed ``T | None``, or with ``defaults`` the field's own default and type."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in cli_settings(cls):
        base = _option_type(hints[field.name])
        kind = hints[field.name] if defaults else base | None
        out.append(
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=field.default if defaults else None,
                annotation=Annotated[kind, _option(field, base, panel, None)],
            )
        )
    return out


def option_of(cls: type, name: str, help: str | None = None) -> Any:
    """The option of the field ``name`` of ``cls`` alone, as an annotation (``help``: instead
    of the declared one); its default is the field's (``DEFAULT_QUERY.max_new_tokens``)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = typing.get_type_hints(cls)[name]
    return Annotated[hint, _option(field, _option_type(hint), None, help)]


def _decorate(
    fn: Callable, into: str, generated: list[inspect.Parameter], build: Callable
) -> Callable:
    """``fn`` with its parameter ``into`` replaced by the ``generated`` options; it receives
    ``build({name: value})`` in ``into``."""
    own = inspect.signature(fn, eval_str=True)
    if into not in own.parameters:
        raise TypeError(f"{fn.__name__} needs a parameter named {into}")
    names = [p.name for p in generated]
    clash = set(names) & set(own.parameters)
    if clash:
        raise TypeError(f"{fn.__name__} declares settings options itself: {sorted(clash)}")
    kept = [p for name, p in own.parameters.items() if name != into]

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name, None) for name in names}
        return fn(*args, **{into: build(given)}, **kwargs)

    del command.__wrapped__  # Typer must read the signature below, not fn's
    params = [*kept, *generated]
    command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    if own.return_annotation is not inspect.Signature.empty:
        command.__annotations__["return"] = own.return_annotation
    return command


def with_settings_options(cls: type, panel: str = PANEL) -> Callable[[Callable], Callable]:
    """Decorate a Typer command that has a parameter ``overrides: dict[str, Any]``: the
    command gets one option per ``cli=True`` field of ``cls`` and receives their values in
    ``overrides`` (None for an option not given)."""

    def decorate(fn: Callable) -> Callable:
        return _decorate(fn, "overrides", settings_parameters(cls, panel), dict)

    return decorate


def with_options(cls: type) -> Callable[[Callable], Callable]:
    """Decorate a Typer command that has a parameter ``options`` (an instance of ``cls``, an
    options class such as ``QueryOptions``): the command gets one option per field of ``cls``,
    with the field's default and help, and receives ``cls(**values)`` in ``options``, its
    ``choices`` checked (a :class:`SettingsError` naming the flag: exit 2)."""

    def build(values: dict[str, Any]) -> Any:
        options = cls(**values)
        check_choices(options, lambda name: _flag(_fields(cls)[name], None))
        return options

    def decorate(fn: Callable) -> Callable:
        return _decorate(fn, "options", settings_parameters(cls, None, defaults=True), build)

    return decorate


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}
