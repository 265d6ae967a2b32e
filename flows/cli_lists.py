"""List options that take several values after one flag: ``--kc 1 2 4`` as well as
``--kc 1 --kc 2 --kc 4`` (Click's own form, which stays valid).

Click gives an option one value per occurrence; :class:`ListOptionsCommand` rewrites the
arguments before Click parses them. After a list option's first value, the next tokens are
more of its values while they fit it: numbers for a number option, one of its known values for
an option listed in :data:`KNOWN_VALUES` (``--methods``, ``coinrag@base`` too;
``--retrieval``), a
``NAME=VALUE`` pair for one in :data:`PAIR_VALUES` (``--model``, ``--limit-for``), and, for a
string option of a command without positional arguments (``train cartridges --docs a b``),
anything that does not start with ``-``. So a positional argument after a list option is never
taken as one of its values (``eval --kc 1 2 questions.jsonl`` keeps ``questions.jsonl`` as
QUESTIONS).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperOption

from coinrag.schemas.settings import RAG_METHODS, RETRIEVAL_MODES

# --methods also as NAME@LABEL
KNOWN_VALUES: dict[str, Sequence[str]] = {"--methods": RAG_METHODS, "--retrieval": RETRIEVAL_MODES}
# Options whose values are NAME=VALUE pairs (``eval --model base=default links=DIR``,
# ``--limit-for standard=20``): a token with ``=`` is one more value (and ``default``, the
# store's model, for ``--model``).
PAIR_VALUES: dict[str, Sequence[str]] = {"--model": ("default",), "--limit-for": ()}


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _item_type(param: TyperOption) -> Any:
    """The element type of a list option (``list[int] | None`` -> ``int``)."""
    annotation = param.type_descriptor.annotation
    for arg in (annotation, *typing.get_args(annotation)):
        items = typing.get_args(arg)
        if typing.get_origin(arg) is list and items:
            return items[0]
    return str


def _fits(param: TyperOption, option: str, token: str, free_strings: bool) -> bool:
    """Whether ``token`` can be one more value of the list option ``param``."""
    if option in KNOWN_VALUES:
        return token.partition("@")[0] in KNOWN_VALUES[option]
    if option in PAIR_VALUES:
        pair = "=" in token and not token.startswith("-")
        return pair or token in PAIR_VALUES[option]
    if _item_type(param) in (int, float):
        return _is_number(token)
    return free_strings and not token.startswith("-")


def expand_list_options(command: TyperCommand, args: Sequence[str]) -> list[str]:
    """``[..., "--kc", "1", "2", ...]`` -> ``[..., "--kc", "1", "--kc", "2", ...]``."""
    lists = {
        opt: p
        for p in command.params
        if isinstance(p, TyperOption) and p.multiple
        for opt in p.opts
    }
    free_strings = not any(isinstance(p, TyperArgument) for p in command.params)
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        out.append(token)
        i += 1
        if token == "--":
            out += args[i:]
            break
        name, eq, _ = token.partition("=")
        param = lists.get(name)
        if param is None:
            continue
        if not eq and i < len(args):  # its first value, as Click takes it
            out.append(args[i])
            i += 1
        while i < len(args) and _fits(param, name, args[i], free_strings):
            out += [name, args[i]]
            i += 1
    return out


class ListOptionsCommand(TyperCommand):
    """A Typer command whose list options also take ``--opt a b c`` (see the module doc)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, expand_list_options(self, args))
