"""The query options are declared once (``schemas.settings.QueryOptions`` / ``EvalOptions``):
``coinrag query``'s options, ``coinrag eval``'s, ``coinrag api``'s default ``--max-new-tokens``
and the server's request fields all come from that declaration, with the same defaults and
bounds; errors declare their exit status and HTTP status, mapped once each."""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.flows.cli.root import CoinragGroup, exit_code_of
from coinrag.flows.preflight import Preflight
from coinrag.inference.methods import MissingAssets
from coinrag.inference.server.app import ServerConfig, http_status_of
from coinrag.inference.server.queue import Cancelled, QueueFull
from coinrag.inference.server.requests import FIELDS, BadRequest, parse_query
from coinrag.schemas.qa import BlankQuestion
from coinrag.schemas.settings import (
    DEFAULT_QUERY,
    RAG_METHODS,
    ApiSettings,
    EvalOptions,
    FinetuneSettings,
    QueryOptions,
    SettingsError,
)
from coinrag.schemas.training_settings import KvLinkOptions
from coinrag.storage.store import StoreLocked


def _options(*path: str) -> dict[str, typer.core.TyperOption]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def test_every_query_option_is_a_cli_option_and_a_request_field_with_one_default() -> None:
    cli = _options("query")
    request = parse_query(b'{"question": "Q?"}', ApiSettings(), RAG_METHODS, 32)
    for field in dataclasses.fields(QueryOptions):
        option = cli[field.name]
        assert option.opts == ["--" + field.name.replace("_", "-")]
        assert option.default == field.default == getattr(request, field.name)
        assert option.min == field.metadata["min"]
        assert field.name in FIELDS
    assert set(FIELDS) == {f.name for f in dataclasses.fields(QueryOptions)} | {
        "question",
        "stream",
    }
    # coinrag api: a request's max_new_tokens when it gives none, the same default
    assert _options("api")["max_new_tokens"].default == DEFAULT_QUERY.max_new_tokens
    assert ServerConfig("store").max_new_tokens == DEFAULT_QUERY.max_new_tokens


def test_every_eval_option_is_a_cli_option_of_eval_with_its_default() -> None:
    cli = _options("eval")
    for field in dataclasses.fields(EvalOptions):
        assert cli[field.name].default == field.default, field.name
    assert EvalOptions().max_new_tokens == DEFAULT_QUERY.max_new_tokens
    assert EvalOptions().sweep == ((DEFAULT_QUERY.kc, DEFAULT_QUERY.k),)
    assert EvalOptions(kc=[1, 2], k=[5]).sweep == ((1, 5), (2, 5))


def test_every_kvlink_option_is_a_cli_option_of_train_kvlink() -> None:
    cli = _options("train", "kvlink")
    for field in dataclasses.fields(KvLinkOptions):
        assert cli[field.name].default == field.default, field.name
        assert cli[field.name].min == field.metadata["min"], field.name
    finetune = {f.name for f in dataclasses.fields(FinetuneSettings)}
    assert set(KvLinkOptions().training()) <= finetune  # read as FinetuneSettings


def test_the_declared_bounds_and_choices_refuse_alike_on_the_cli_and_the_server() -> None:
    settings = ApiSettings()
    for body, words in (
        ({"question": "Q?", "kc": 0}, "kc must be in 1..64"),
        ({"question": "Q?", "k": settings.max_k + 1}, f"k must be in 1..{settings.max_k}"),
        ({"question": "Q?", "retrieval": "fuzzy"}, "retrieval 'fuzzy' is not one of"),
        ({"question": "Q?", "kc": "4"}, "kc must be an integer"),
        ({"question": "Q?", "oracle_doc": None}, None),
    ):
        raw = json.dumps(body).encode()
        if words is None:
            assert parse_query(raw, settings, RAG_METHODS, 32).doc_ids is None
            continue
        with pytest.raises(BadRequest) as refused:
            parse_query(raw, settings, RAG_METHODS, 32)
        assert refused.value.http_status == 422 and words in str(refused.value)
    with pytest.raises(BlankQuestion):
        parse_query(b'{"question": "  "}', settings, RAG_METHODS, 32)
    for args, words in (
        (["--kc", "0"], "--kc"),
        (["--retrieval", "fuzzy"], "--retrieval 'fuzzy' is not one of"),
        (["--method", "nope"], "--method 'nope' is not one of"),
    ):
        result = CliRunner().invoke(app, ["query", "Q?", "--store", "nowhere", *args])
        assert result.exit_code == 2 and words in result.output, result.output


def test_errors_declare_their_exit_code_and_http_status() -> None:
    assert exit_code_of(SettingsError("x")) == 2 and http_status_of(SettingsError("x")) == 422
    assert exit_code_of(BlankQuestion("x")) == 2 and http_status_of(BlankQuestion("x")) == 422
    assert exit_code_of(MissingAssets("x")) == 1 and http_status_of(MissingAssets("x")) == 500
    assert exit_code_of(Preflight("x", 2)) == 2 and exit_code_of(StoreLocked("x")) == 1
    assert http_status_of(QueueFull("x")) == 503 and http_status_of(Cancelled("x")) == 499
    assert http_status_of(LookupError("no such doc")) == 422
    assert http_status_of(RuntimeError("bug")) == 500 and exit_code_of(RuntimeError("bug")) is None
    assert exit_code_of(typer.Exit(3)) is None  # Typer's own exits keep their status


def test_the_cli_maps_a_declared_error_to_one_line_and_its_status() -> None:
    demo = typer.Typer(cls=CoinragGroup)

    @demo.command()
    def locked() -> None:
        raise StoreLocked("the store is locked by pid 12")

    @demo.command()
    def bug() -> None:
        raise RuntimeError("a bug")

    result = CliRunner().invoke(demo, ["locked"])
    assert result.exit_code == 1
    assert result.output == "error: the store is locked by pid 12\n"
    unexpected = CliRunner().invoke(demo, ["bug"])  # main prints it, naming its type
    assert isinstance(unexpected.exception, RuntimeError)
