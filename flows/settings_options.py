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

from coinrag.schemas.settings import cli_settings

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


def settings_parameters(cls: type, panel: str = PANEL) -> list[inspect.Parameter]:
    """One keyword-only parameter (default None) per ``cli=True`` field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in cli_settings(cls):
        base = _option_type(hints[field.name])
        help_text = str(field.metadata.get("help", "")).format(default=field.default)
        option = typer.Option(
            _flag(field, base),
            help=help_text,
            rich_help_panel=panel,
            min=field.metadata.get("min"),
        )
        out.append(
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[base | None, option],
            )
        )
    return out


def with_settings_options(cls: type, panel: str = PANEL) -> Callable[[Callable], Callable]:
    """Decorate a Typer command that has a parameter ``overrides: dict[str, Any]``: the
    command gets one option per ``cli=True`` field of ``cls`` and receives their values in
    ``overrides`` (None for an option not given)."""

    def decorate(fn: Callable) -> Callable:
        own = inspect.signature(fn, eval_str=True)
        if "overrides" not in own.parameters:
            raise TypeError(f"{fn.__name__} needs a parameter named overrides")
        generated = settings_parameters(cls, panel)
        names = [p.name for p in generated]
        clash = set(names) & set(own.parameters)
        if clash:
            raise TypeError(f"{fn.__name__} declares settings options itself: {sorted(clash)}")
        kept = [p for name, p in own.parameters.items() if name != "overrides"]

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            overrides = {name: kwargs.pop(name, None) for name in names}
            return fn(*args, overrides=overrides, **kwargs)

        del command.__wrapped__  # Typer must read the signature below, not fn's
        params = [*kept, *generated]
        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        if own.return_annotation is not inspect.Signature.empty:
            command.__annotations__["return"] = own.return_annotation
        return command

    return decorate
