"""The KV dtype setting (issue 13, item 1): ``kv_dtype = auto | float32 | bfloat16 | float16``.

- ``auto`` is resolved from the detected capability (``/proc/cpuinfo`` flags on a CPU, the CUDA
  device's own answer), checked here on given cpuinfo texts and on this machine;
- the device string is read as a ``torch.device``: ``cpu:0`` chooses as ``cpu`` does;
- the setting goes from the CLI and from TOML into ``runs.parameters_json``, ``STORE/coinrag.toml``
  and the fingerprints (``model_fp``, hence ``kv_fp``); the stored KV and the model that computes
  it have that dtype, and ``query`` loads the model in the store's dtype, so a bfloat16 store and
  a float32 store of the same corpus both answer.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.model.kv_dtype import cpu_computes_bf16, read_cpuinfo, resolve_kv_dtype
from coinrag.inference.model.loading import default_dtype, reference_model_fingerprint
from coinrag.schemas.settings import BuildSettings, SettingsError, load_settings
from coinrag.schemas.tables import KvManifestRow, RunRow
from coinrag.storage.kv import KvStore, parse_location
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows

# Abridged /proc/cpuinfo "flags" lines of real CPUs.
SAPPHIRE_RAPIDS = (
    "flags\t\t: fpu vme sse sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
)
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
ICE_LAKE = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"  # AVX-512, no BF16
GRAVITON3 = "Features\t: fp asimd evtstrm aes sve bf16 i8mm\n"  # Arm bf16: not x86 AVX512/AMX


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        (SAPPHIRE_RAPIDS, "bfloat16"),
        (ZEN4, "bfloat16"),
        (ICE_LAKE, "float32"),
        (GRAVITON3, "float32"),
        ("", "float32"),  # no /proc/cpuinfo: nothing detected
        ("model name\t: avx512_bf16 in a name, not a flag\n", "float32"),
    ],
    ids=["sapphire-rapids", "zen4", "ice-lake", "graviton3", "none", "not-a-flag"],
)
@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_auto_follows_the_detected_cpu(cpuinfo: str, expected: str, device: str) -> None:
    got = resolve_kv_dtype("auto", device, cpuinfo=cpuinfo)
    assert got.dtype == expected, got.reason
    assert cpu_computes_bf16(cpuinfo) == (expected == "bfloat16")


def test_auto_on_this_machine_and_explicit_settings() -> None:
    native = cpu_computes_bf16(read_cpuinfo())
    assert resolve_kv_dtype("auto", "cpu").dtype == ("bfloat16" if native else "float32")
    for dtype in ("float32", "bfloat16", "float16"):
        assert resolve_kv_dtype(dtype, "cpu:0", cpuinfo=SAPPHIRE_RAPIDS).dtype == dtype
    if not torch.cuda.is_available():
        assert resolve_kv_dtype("auto", "cuda").dtype == "float32"  # not detected: float32
    with pytest.raises(ValueError, match="int8"):
        resolve_kv_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_kv_dtype("auto", "gpu:zero")


def test_cpu0_is_cpu_for_every_dtype_choice() -> None:
    """The accident of issue 13: ``--device cpu:0`` was not ``"cpu"`` and got bfloat16."""
    assert default_dtype("cpu:0") == default_dtype("cpu") == "float32"
    assert default_dtype("cuda:0") == default_dtype("cuda") == "bfloat16"
    assert BuildSettings(device="cpu:0").validate().kv_dtype == "auto"
    assert resolve_kv_dtype("auto", "cpu:0") == resolve_kv_dtype("auto", "cpu")
    assert reference_model_fingerprint(None, "cpu:0") == reference_model_fingerprint(None, "cpu")


def test_setting_is_validated_and_read_from_toml(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="kv_dtype 'int8' is not one of auto, float32"):
        BuildSettings(kv_dtype="int8").validate()
    config = tmp_path / "c.toml"
    config.write_text('[build]\nkv_dtype = "float16"\n')
    assert load_settings(config).kv_dtype == "float16"
    assert load_settings(config, {"kv_dtype": "bfloat16"}).kv_dtype == "bfloat16"  # CLI wins
    assert load_settings(None).kv_dtype == "auto"


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def corpus_and_model(tmp_path_factory, smollm2_tokenizer, sample_corpus: Path):
    root = tmp_path_factory.mktemp("kvdtype")
    source = write_corpus(root / "docs.jsonl", sample_docs(sample_corpus, 3))
    return source, save_tiny_llama(root / "llama", smollm2_tokenizer, 5)


def _build(store: Path, source: Path, model: Path, *args: str) -> None:
    result = CliRunner().invoke(
        app,
        ["build", str(source), "--store", str(store), "--extractor", "rules"]
        + ["--model", str(model), "--chunk-size", "64", *args],
    )
    assert result.exit_code == 0, result.output


def _recorded(store: Path) -> tuple[dict, dict, dict]:
    """(runs.parameters_json, runs.fingerprints_json, [build] of coinrag.toml) of the build."""
    (run,) = [r for r in read_rows(Store.at(store), RunRow) if r.status == "completed"]
    toml = tomllib.loads((store / "coinrag.toml").read_text())
    return json.loads(run.parameters_json), json.loads(run.fingerprints_json), toml["build"]


@pytest.mark.heavy  # over 10 s: the second tier
@pytest.mark.usefixtures("prefect_harness")
def test_bf16_and_fp32_stores_differ_in_kv_fp_and_both_answer(
    tmp_path: Path, corpus_and_model
) -> None:
    source, model = corpus_and_model
    config = tmp_path / "bf16.toml"
    config.write_text('[build]\nkv_dtype = "bfloat16"\n')
    stores = {"bfloat16": tmp_path / "bf16", "float32": tmp_path / "fp32"}
    _build(stores["bfloat16"], source, model, "--config", str(config))  # from TOML
    _build(stores["float32"], source, model, "--kv-dtype", "float32")  # from the CLI
    kv_fps = {}
    for dtype, store in stores.items():
        params, fps, toml = _recorded(store)
        assert params["kv_dtype"] == toml["kv_dtype"] == dtype
        kv = KvStore.open(Store.at(store), fps["kv_fp"])
        assert kv.layout.dtype == dtype and kv.layout.model_fp == fps["model_fp"]
        rows = read_rows(Store.at(store), KvManifestRow)
        assert rows and {parse_location(r.location)[0] for r in rows} == {fps["kv_fp"]}
        assert {r.model_fp for r in rows} == {fps["model_fp"]}
        entry = kv.read_entry(rows[0].content_key)
        assert entry.dtype == getattr(torch, dtype)
        kv_fps[dtype] = (fps["kv_fp"], fps["model_fp"])
        for method in ("turborag", "coinrag"):
            result = CliRunner().invoke(
                app,
                ["query", "Who directed 2001: A Space Odyssey?", "--store", str(store)]
                + ["--method", method, "--kc", "2", "--k", "4", "--max-new-tokens", "4", "--json"],
            )
            assert result.exit_code == 0, result.output
            answer = json.loads(result.stdout.strip().splitlines()[-1])
            assert answer["evidence"] and answer["timings"]["kv_load"] > 0
    assert kv_fps["bfloat16"][0] != kv_fps["float32"][0]
    assert kv_fps["bfloat16"][1] != kv_fps["float32"][1]
    # A store whose recorded kv_dtype is not the one its KV was built in (e.g. built before the
    # setting existed, read with auto): one clear error naming the dtype and the way out.
    toml = stores["float32"] / "coinrag.toml"
    toml.write_text(toml.read_text().replace('kv_dtype = "float32"', 'kv_dtype = "bfloat16"'))
    result = CliRunner().invoke(app, ["query", "q", "--store", str(stores["float32"])])
    assert result.exit_code == 1
    message = " ".join(result.output.split())
    assert "no KV for model" in message and "in bfloat16" in message
    assert "--kv-dtype bfloat16" in message


@pytest.mark.usefixtures("prefect_harness")
def test_auto_records_what_it_resolved_to(tmp_path: Path, corpus_and_model) -> None:
    source, model = corpus_and_model
    store = tmp_path / "auto"
    _build(store, source, model, "--device", "cpu:0")  # kv_dtype auto by default
    params, fps, toml = _recorded(store)
    expected = "bfloat16" if cpu_computes_bf16(read_cpuinfo()) else "float32"
    assert params["kv_dtype"] == toml["kv_dtype"] == expected
    assert KvStore.open(Store.at(store), fps["kv_fp"]).layout.dtype == expected
    bad = CliRunner().invoke(app, ["build", str(source), "--store", str(store), "--kv-dtype", "q"])
    assert bad.exit_code == 2 and "kv_dtype 'q' is not one of" in bad.output


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.heavy  # over 5 s: the second tier
def test_frozen_training_on_a_bf16_store_and_its_kv_rebuild(
    tmp_path: Path, corpus_and_model
) -> None:
    """``train nuggets --mode frozen`` computes in float32 on the store's bfloat16 KV (cast at
    assembly); the model_fp it records is the one the KV rebuild stores under, and the store
    then answers with the new model at bfloat16."""
    from coinrag.flows.train import train_nuggets
    from coinrag.inference.methods import RagEngine

    _, model = corpus_and_model
    text = "Zorvath is a mountain town in Keldia. It was founded in 1724 by Ilsa Moren."
    data = tmp_path / "qa.jsonl"
    line = {"question": "Who founded Zorvath?", "answer": "Ilsa Moren"}
    line["documents"] = [{"id": "zorvath", "text": text, "gold": True}]
    data.write_text(json.dumps(line) + "\n")
    store = tmp_path / "store"
    s = train_nuggets(
        store,
        data,
        tmp_path / "ft",
        mode="frozen",
        max_steps=1,
        model=str(model),
        build={"extractor": "rules", "chunk_size": 24, "kv_dtype": "bfloat16"},
        rebuild_kv=True,
        batch_size=1,
        kc=1,
        k=2,
    )
    assert s["steps"] == 1 and s["config"]["dtype"] is None  # trained in float32 (CPU)
    rebuilt = [r for r in read_rows(Store.at(store), RunRow) if r.status == "completed"]
    fps = json.loads(
        next(r for r in rebuilt if r.run_id == s["kv_rebuild"]["run_id"]).fingerprints_json
    )
    assert fps["model_fp"] == s["model_fp"] != s["base_model_fp"]
    assert KvStore.open(Store.at(store), fps["kv_fp"]).layout.dtype == "bfloat16"
    engine = RagEngine.open(str(store), max_new_tokens=2)
    assert engine.loaded.model_fp == s["model_fp"]
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.answer("Who founded Zorvath?", "coinrag", kc=1, k=2).evidence
