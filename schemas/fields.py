"""How a setting or an option is declared: :func:`setting` (a dataclass field with its help,
bounds, choices and whether it is a command-line option), :func:`check_choices`, and
:class:`SettingsError`. The settings classes themselves: ``schemas/settings.py`` (build, runtime,
server, query and eval options, fine-tuning) and ``schemas/training_settings.py`` (cartridges,
KVLink)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


class SettingsError(ValueError):
    """A setting with an invalid value, or an unknown setting name: a usage error (the CLI
    exits 2, the server answers 422)."""

    exit_code = 2
    http_status = 422


def setting(
    default: Any,
    help: str = "",
    *,
    cli: bool = False,
    flag: str | None = None,
    min: float | None = None,
    choices: tuple[str, ...] | None = None,
    cap: str | None = None,
) -> Any:
    """A dataclass field with its documentation: ``help`` (``{default}`` in it becomes the
    default) and, with ``cli=True``, a command-line option of the commands that take these
    settings (``flows/settings_options.py``; ``flag``: its name when not ``--field-name``;
    ``min``: the least value the option accepts; ``choices``: the values it accepts, checked by
    :func:`check_choices`; ``cap``: the :class:`ApiSettings` field that bounds it in a server
    request). Plain values only: ``schemas/`` knows no CLI library."""
    meta = {"help": help, "cli": cli, "flag": flag, "min": min, "choices": choices, "cap": cap}
    return dataclasses.field(default=default, metadata=meta)


def check_choices(options: Any, name_of: Callable[[str], str] = str) -> None:
    """:class:`SettingsError` for a field of ``options`` (a dataclass) outside its declared
    ``choices`` (a list field: every item); ``name_of(field name)`` names it in the message
    (the CLI: its flag; the server: the request field)."""
    for field in dataclasses.fields(options):
        choices, value = field.metadata.get("choices"), getattr(options, field.name)
        if not choices or value is None:
            continue
        if isinstance(value, list | tuple):
            bad = [v for v in value if v not in choices]
            if bad:
                name = name_of(field.name)
                raise SettingsError(f"{name} {' '.join(bad)}: not among {', '.join(choices)}")
        elif value not in choices:
            name = name_of(field.name)
            raise SettingsError(f"{name} {value!r} is not one of {', '.join(choices)}")
