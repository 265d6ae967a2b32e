"""The build settings' CLI options come from one declaration (schemas/settings.py): `build` and
`serve` take the same ones, and `serve` hands them to its deployment as `build` to its flow."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.core import TyperOption
from typer.testing import CliRunner

from coinrag.flows import cli
from coinrag.schemas.settings import BuildSettings, cli_settings


def _setting_options(name: str) -> dict[str, TyperOption]:
    command = typer.main.get_command(cli.app).commands[name]  # type: ignore[attr-defined]
    return {
        p.name: p
        for p in command.params
        if isinstance(p, TyperOption) and p.name in {f.name for f in cli_settings(BuildSettings)}
    }


def test_build_and_serve_take_every_cli_setting() -> None:
    declared = {f.name for f in cli_settings(BuildSettings)}
    build, serve = _setting_options("build"), _setting_options("serve")
    assert set(build) == set(serve) == declared
    for name in declared:
        assert build[name].opts == serve[name].opts
        assert build[name].help == serve[name].help
        assert build[name].default is None and serve[name].default is None
    assert build["prune"].opts == ["--prune"] and build["prune"].is_flag
    assert build["chunk_size"].opts == ["--chunk-size"]
    assert build["tau"].help == "Fuzzy recovery threshold (default 0.7)."


def test_serve_passes_every_build_option_to_its_deployment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the options were generated, `serve` lacked --runner & co (exit 2)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import coinrag.flows.deployments as deployment

    seen: dict = {}

    def make(source, store, settings, **kw):
        seen.update(source=source, store=store, settings=settings, **kw)
        return ["deployment"]

    monkeypatch.setattr(deployment, "make_serve_deployments", make)
    monkeypatch.setattr(deployment, "serve_build", lambda d: seen.setdefault("served", d))
    store = tmp_path / "store"
    args = [
        "serve", "sample", "--store", str(store), "--runner", "dask", "--workers", "3",
        "--runner-address", "tcp://h:8786", "--kv-resources", "GPU=1", "--device", "cpu",
        "--prune", "--chunk-size", "256", "--kv-dtype", "float32",
    ]  # fmt: skip
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert seen["served"] == ["deployment"]
    want = {
        "runner": "dask",
        "workers": 3,
        "runner_address": "tcp://h:8786",
        "kv_resources": "GPU=1",
        "device": "cpu",
        "prune": True,
        "chunk_size": 256,
        "kv_dtype": "float32",
    }
    assert {k: seen["settings"][k] for k in want} == want
    assert seen["settings"] == BuildSettings(**want).to_dict()


def test_train_nuggets_options_come_from_the_finetune_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train nuggets --mode/--lora/--max-steps` are the cli=True fields of FinetuneSettings,
    with their checks (--max-steps 0 and an unknown mode are usage errors), and reach the flow
    as its arguments."""
    import json

    import coinrag.flows.train as train
    from coinrag.schemas.settings import FinetuneSettings

    command = typer.main.get_command(cli.app).commands["train"].commands["nuggets"]  # type: ignore[attr-defined]
    declared = {f.name for f in cli_settings(FinetuneSettings)}
    options = {p.name: p for p in command.params if p.name in declared}
    assert set(options) == declared == {"mode", "lora", "max_steps"}
    assert options["lora"].opts == ["--lora"] and options["lora"].is_flag
    assert options["max_steps"].help == "Stop after N optimizer steps."

    store, data = tmp_path / "store", tmp_path / "qa.jsonl"
    line = {"question": "Q?", "answer": "A", "documents": [{"id": "d", "text": "A text."}]}
    data.write_text(json.dumps(line) + "\n")
    out = tmp_path / "model"
    base = ["train", "nuggets", "--store", str(store), "--data", str(data), "--out", str(out)]
    zero = CliRunner().invoke(cli.app, [*base, "--max-steps", "0"])
    assert zero.exit_code == 2 and "--max-steps" in zero.output
    bad = CliRunner().invoke(cli.app, [*base, "--mode", "thawed"])
    assert bad.exit_code == 2 and "--mode 'thawed' is not one of live, frozen" in bad.output

    seen: dict = {}
    monkeypatch.setattr(cli.common, "prefect_run", lambda: None)
    monkeypatch.setattr(train, "train_nuggets", lambda *a, **kw: seen.update(kw) or {"ok": 1})
    ok = CliRunner().invoke(cli.app, [*base, "--mode", "frozen", "--lora", "--max-steps", "3"])
    assert ok.exit_code == 0, ok.output
    assert seen == {"rebuild_kv": False, "mode": "frozen", "lora": True, "max_steps": 3}
    seen.clear()
    assert CliRunner().invoke(cli.app, base).exit_code == 0
    assert seen == {"rebuild_kv": False}  # the flow's defaults (FinetuneSettings')
