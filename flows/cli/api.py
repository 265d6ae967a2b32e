"""``coinrag api``: serve a store over HTTP (``inference/server/``). A request's fields and
their defaults are ``schemas.settings.QueryOptions``, as ``coinrag query``'s options are."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from coinrag.flows.cli.common import BuiltStore, ModelOption
from coinrag.flows.settings_options import option_of, with_settings_options
from coinrag.schemas.secrets import API_KEY_ENV
from coinrag.schemas.settings import DEFAULT_QUERY, ApiSettings, QueryOptions

DefaultMaxNewTokens = option_of(
    QueryOptions, "max_new_tokens", help="A request's max_new_tokens when it gives none."
)


@with_settings_options(ApiSettings, panel="Server settings")
def api(
    store: BuiltStore,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int, typer.Option(min=1, help="Server processes (each loads the model once).")
    ] = 1,
    methods: Annotated[
        list[str] | None,
        typer.Option(
            "--methods",
            help="Methods served (default: coinrag turborag standard): --methods coinrag",
        ),
    ] = None,
    model: ModelOption = None,
    max_new_tokens: DefaultMaxNewTokens = DEFAULT_QUERY.max_new_tokens,
    config: Annotated[
        Path | None, typer.Option(help="TOML file with an \\[api] table of the server settings.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_default=False,
            help="API key requests must send (Authorization: Bearer KEY); prefer the env var.",
        ),
    ] = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Serve STORE over HTTP: POST /query (and streaming), GET /health, GET /metrics.

    Loads the model, embedder, index and KV readers once and warms them; follows every version
    a build, delete or gc publishes (in-flight requests finish on theirs). Runs until Ctrl-C.
    Listening beyond loopback (--host 0.0.0.0) needs an API key (or --insecure). Also serves
    the store explorer at /ui behind the same key (--no-ui: the API only).
    """
    import dataclasses
    import logging

    from coinrag.flows import preflight
    from coinrag.flows.cli import common
    from coinrag.schemas.settings import DEFAULT_RAG_METHODS, RAG_METHODS, load_api_settings

    bad = [m for m in methods or [] if m not in RAG_METHODS]
    if bad:
        common.fail(f"--methods {' '.join(bad)}: not among {', '.join(RAG_METHODS)}", 2)
    settings = load_api_settings(config, overrides)
    from coinrag.inference.server.app import LOG_FORMAT, ServerConfig, serve

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    insecure = preflight.api_access(host, api_key, settings)  # before the port binds
    if insecure:
        logging.getLogger("coinrag.api").warning(insecure)
    preflight.built_store(store)
    if model is not None:
        preflight.model(model)
    served = ServerConfig(
        store=str(store),
        model=model,
        methods=tuple(dict.fromkeys(methods or DEFAULT_RAG_METHODS)),
        max_new_tokens=max_new_tokens,
        settings=dataclasses.asdict(settings),
        api_key=api_key,
    )
    with common.exit_on(1, LookupError, ValueError):
        serve(served, host, port, workers)
