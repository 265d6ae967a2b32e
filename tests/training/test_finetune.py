"""Nugget-aware fine-tuning (training/finetune.py, flows/train.py) on a tiny random Qwen2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from store_fixtures import TINY_DIMS

from coinrag.inference.context.builders import LiveKvContext, StoredKvContext
from coinrag.schemas.qa import DataError, load_examples
from coinrag.schemas.settings import FinetuneSettings
from coinrag.training.data import make_plans, raft_drop, write_documents
from coinrag.training.finetune import run_training
from coinrag.training.job import TrainJob
from coinrag.training.loop import Killed, RunControl
from coinrag.training.objective import answer_loss_sum, attach_lora

DOCS = {
    "zorvath": "Zorvath is a mountain town in northern Keldia. The town was founded in 1724 by "
    "the glassmaker Ilsa Moren. Its main export is blue glass, sold across the coast.",
    "keldia": "Keldia is a small republic by the Amber Sea. Its capital is Port Vessa. The "
    "republic uses the keld as its currency and has two official languages.",
    "moren": "Ilsa Moren was a glassmaker born in Port Vessa. She studied in Venice and later "
    "moved to the mountains. Her workshop trained more than forty apprentices.",
    "amber": "The Amber Sea is a shallow inland sea. Fishing boats leave from Port Vessa every "
    "morning. The sea freezes near the shore in the coldest winters.",
}
QA = [
    ("Who founded Zorvath?", "Ilsa Moren", "zorvath", "amber"),
    ("What is the capital of Keldia?", "Port Vessa", "keldia", "moren"),
    ("Where did Ilsa Moren study?", "Venice", "moren", "zorvath"),
    ("What currency does Keldia use?", "the keld", "keldia", "amber"),
]


def _qa_lines() -> list[dict]:
    return [
        {
            "question": q,
            "answer": a,
            "documents": [
                {"id": gold, "text": DOCS[gold], "gold": True},
                {"id": other, "text": DOCS[other]},
            ],
        }
        for q, a, gold, other in QA
    ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(smollm2_tokenizer),
        **TINY_DIMS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # embedding rows get gradient only from input tokens
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model, prefect_harness):
    """A store with the QA documents built (rules extractor, the tiny model's KV)."""
    from coinrag.flows.build import build_flow

    root = tmp_path_factory.mktemp("train-nuggets")
    data = root / "qa.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in _qa_lines()))
    examples = load_examples(data)
    write_documents(examples, root / "docs.jsonl")
    store = root / "store"
    # float32 KV: the tests below compare training and inference contexts at float32 tolerances
    # (a bfloat16 store is trained on in tests/storage/test_kv_dtype.py).
    settings = {"extractor": "rules", "model": str(tiny_model), "chunk_size": 24}
    build_flow(str(root / "docs.jsonl"), str(store), {**settings, "kv_dtype": "float32"})
    return {"root": root, "data": data, "store": store, "model": tiny_model, "ex": examples}


@pytest.fixture(scope="module")
def parts(built):
    from coinrag.inference.model.encode import kv_layout
    from coinrag.inference.model.loading import load_model
    from coinrag.inference.model.prompt import RagPrompt
    from coinrag.inference.retrieval.embedders import load_embedder
    from coinrag.inference.retrieval.retriever import Retriever
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store

    store = Store.at(built["store"])
    loaded = load_model(built["model"])
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    emb = load_embedder("minilm")
    retriever = Retriever(store, emb)
    layout = kv_layout(loaded, prompt)
    kv = KvStore.open(store, layout.kv_fp, layout)
    return {
        "store": store,
        "loaded": loaded,
        "prompt": prompt,
        "emb": emb,
        "ret": retriever,
        "kv": kv,
    }


def _cfg(**kw) -> FinetuneSettings:
    base = {
        "batch_size": 2,
        "lr": 3e-3,
        "kc": 2,
        "k": 4,
        "schedule": "constant",
        "warmup_ratio": 0.0,
        "checkpoint_every": 2,
    }
    return FinetuneSettings(**{**base, **kw}).validate()


# ------------------------------------------------------------------------------------------ data


def test_data_validation(tmp_path):
    bad = [
        ("{not json", "not valid JSON"),
        ('{"question": "q", "answer": "a"}', "exactly one of"),
        ('{"question": "", "answer": "a", "doc_ids": ["x"]}', "'question'"),
        ('{"question": "q", "answer": "a", "documents": [{"id": "x"}]}', "text"),
        ('{"question": "q", "answer": "a", "doc_ids": ["x"], "gold_doc_ids": ["y"]}', "gold"),
    ]
    for line, msg in bad:
        p = tmp_path / "d.jsonl"
        p.write_text('{"question": "q", "answer": "a", "doc_ids": ["x"]}\n' + line + "\n")
        with pytest.raises(DataError, match=msg) as err:
            load_examples(p)
        assert ":2:" in str(err.value)
    p.write_text(
        '{"question": "q", "answer": "a", "documents": [{"id": "x", "text": "t"}]}\n'
        '{"question": "q", "answer": "a", "documents": [{"id": "x", "text": "u"}]}\n'
    )
    with pytest.raises(DataError, match="another text"):
        load_examples(p)


def test_raft_rate_and_gold_removal(built, parts):
    p = 0.15
    rate = sum(raft_drop(7, 0, i, p) for i in range(1000)) / 1000
    assert abs(rate - p) < 3 * math.sqrt(p * (1 - p) / 1000), rate
    assert raft_drop(7, 0, 3, p) == raft_drop(7, 0, 3, p)  # seeded
    plans, _ = make_plans(
        built["ex"], parts["ret"], parts["prompt"], parts["loaded"].tokenizer, _cfg(kc=4, k=8)
    )
    for pl, ex in zip(plans, built["ex"], strict=True):
        assert {e.doc_id for e in pl.evidence} <= set(ex.doc_ids)  # restricted retrieval
        assert any(pl.gold)
        assert not {e.doc_id for e in pl.context(True)} & set(ex.gold_doc_ids)
        assert pl.context(False) == pl.evidence


# --------------------------------------------------------------------------------------- context


def test_training_context_equals_inference_context(built, parts, monkeypatch):
    import coinrag.inference.methods as methods
    import coinrag.inference.methods.kv_reuse as kv_reuse

    loaded, prompt = parts["loaded"], parts["prompt"]
    engine = methods.RagEngine(parts["store"], loaded, parts["emb"], max_new_tokens=1)
    captured = []
    real = kv_reuse.prefill_and_decode
    monkeypatch.setattr(
        kv_reuse,
        "prefill_and_decode",
        lambda model, tok, kv, *a, **kw: captured.append(kv) or real(model, tok, kv, *a, **kw),
    )
    frozen = StoredKvContext(parts["store"], loaded.model, prompt, parts["kv"])
    live = LiveKvContext(parts["store"], loaded.model, prompt)
    for ex in built["ex"]:
        ret = parts["ret"].two_stage(ex.question, kc=2, k=4, doc_ids=ex.doc_ids)
        assert ret.evidence
        engine.run(ex.question, "coinrag", ret)
        n_query = len(prompt.query_ids(ex.question))
        ctx, total = frozen.build(ret.evidence, n_query)
        assert torch.equal(ctx, captured[-1])  # the same tensors
        assert total == ctx.shape[-2]
        with torch.no_grad():
            ctx_live, total_live = live.build(ret.evidence, n_query)
        assert total_live == total
        torch.testing.assert_close(ctx_live, ctx, atol=1e-5, rtol=1e-4)  # batched recompute


# ------------------------------------------------------------------------------------- gradients


def _grads(parts, mode: str, lora: bool = False):
    from coinrag.inference.model.loading import load_model

    loaded = load_model(parts["loaded"].model_dir)
    net = attach_lora(loaded.model, _cfg(lora=True)) if lora else loaded.model
    prompt = parts["prompt"]
    if mode == "frozen":
        b = StoredKvContext(parts["store"], net, prompt, parts["kv"])
    else:
        b = LiveKvContext(parts["store"], net, prompt)
    q, a = prompt.query_ids("Who founded Zorvath?"), [1, 2, 3]
    ev = parts["ret"].two_stage("Who founded Zorvath?", 2, 4, doc_ids=["zorvath"]).evidence
    ctx, total = b.build(ev, len(q))
    loss = answer_loss_sum(net, ctx, total, q, a)
    loss.backward()
    chunk_only = set(b.chunk_token_ids([e.chunk_id for e in ev]).values().__iter__().__next__())
    chunk_only -= set(q) | set(a) | set(prompt.prefix_ids)
    return net, ctx, chunk_only


def test_gradients_live_reach_chunk_encoding(parts):
    net, ctx, chunk_only = _grads(parts, "live")
    assert ctx.requires_grad
    emb = net.model.embed_tokens.weight.grad
    rows = sorted(chunk_only)
    assert rows and emb[rows].abs().sum() > 0  # tokens seen only inside chunks get gradient
    assert net.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in net.parameters())


def test_gradients_frozen_only_query_pass(parts):
    net, ctx, chunk_only = _grads(parts, "frozen")
    assert not ctx.requires_grad
    emb = net.model.embed_tokens.weight.grad
    assert emb[sorted(chunk_only)].abs().sum() == 0  # chunk encoding is not trained
    assert net.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0  # query keys


def test_gradients_lora_only_adapters(parts):
    net, ctx, _ = _grads(parts, "live", lora=True)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in net.named_parameters()
        if "lora_B" in n
    )
    assert all(p.grad is None for n, p in net.named_parameters() if not p.requires_grad)


# -------------------------------------------------------------------------------------- training


def test_loss_goes_down(built, tmp_path):
    s = run_training(
        TrainJob(built["store"], built["data"], tmp_path / "m", model=str(built["model"])),
        _cfg(batch_size=4, epochs=10, lr=1e-2, raft_p=0.0, checkpoint_every=100),
        RunControl(lineage={"run_id": "train-test"}),
    )
    written = json.loads((tmp_path / "m" / "coinrag-training.json").read_text())
    assert s["run_id"] == written["run_id"] == "train-test"  # the caller's lineage, recorded
    assert s["counts"]["usable"] == 4 and s["counts"]["examples_seen"] == 40
    losses = s["losses"]
    assert len(losses) == 10
    assert losses[-1] < 0.6 * losses[0], losses
    assert (tmp_path / "m" / "loss.png").stat().st_size > 0
    assert len((tmp_path / "m" / "train_log.jsonl").read_text().splitlines()) == 10


@pytest.mark.heavy  # over 5 s: the second tier
def test_resume_after_kill_same_next_loss(built, tmp_path):
    cfg = _cfg(epochs=2, raft_p=0.5)
    ref = run_training(
        TrainJob(built["store"], built["data"], tmp_path / "a", model=str(built["model"])), cfg
    )["losses"]

    def kill(step, loss):
        if step == 3:
            raise Killed("simulated kill")

    with pytest.raises(Killed):
        run_training(
            TrainJob(built["store"], built["data"], tmp_path / "b", model=str(built["model"])),
            cfg,
            RunControl(on_step=kill),
        )
    got = run_training(
        TrainJob(built["store"], built["data"], tmp_path / "b", model=str(built["model"])), cfg
    )
    assert got["resumed_from"] == 2  # the checkpoint before the kill
    assert got["losses"] == ref  # bit-equal, including the steps after the resume


@pytest.mark.heavy  # over 5 s: the second tier
def test_flow_frozen_lora_lineage_and_fingerprint(built, tmp_path):
    from coinrag.flows.train import train_nuggets
    from coinrag.inference.model.loading import load_model
    from coinrag.schemas.tables import RunRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_table

    out = tmp_path / "ft"
    s = train_nuggets(
        built["store"],
        built["data"],
        out,
        mode="frozen",
        lora=True,
        max_steps=2,
        model=str(built["model"]),
        build={"extractor": "rules", "chunk_size": 24},
        batch_size=2,
        kc=2,
        k=4,
        lr=1e-3,
    )
    assert s["steps"] == 2
    reloaded = load_model(out)
    assert reloaded.model_fp == s["model_fp"] != s["base_model_fp"]
    assert not any("lora" in n for n, _ in reloaded.model.named_parameters())
    runs = read_table(Store.at(built["store"]), RunRow).to_pylist()
    mine = [r for r in runs if r["flow"] == "train-nuggets" and r["status"] == "completed"]
    assert mine and json.loads(mine[-1]["fingerprints_json"])["model_fp"] == s["model_fp"]
    assert json.loads(mine[-1]["parameters_json"])["hyperparameters"]["lr"] == 1e-3


def test_deployment_constructs():
    from coinrag.flows.deployments import make_train_deployment

    dep = make_train_deployment("/s", "/d.jsonl", "/o")
    assert dep.triggers and "prefect.flow-run.Completed" in dep.triggers[0].expect
    assert dep.triggers[0].match_related.root["prefect.resource.name"] == "coinrag-build"
    assert make_train_deployment("/s", "/d.jsonl", "/o", cron="0 3 * * *").schedules
    with pytest.raises(TypeError, match="lr"):  # not a parameter of the flow
        make_train_deployment("/s", "/d.jsonl", "/o", lr=1e-3)


@pytest.mark.heavy  # over 5 s: the second tier
def test_flow_rebuild_kv_serves_the_new_model_with_its_own_cache(built, tmp_path):
    """rebuild_kv=True: the store gets KV computed by the new weights under the new kv_fp
    (what the new model computes itself), chunks and nuggets are reused, the base model's
    cache is untouched, and the store's model becomes the fine-tuned one."""
    import shutil

    import pyarrow.compute as pc

    from coinrag.flows.train import train_nuggets
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.model.encode import from_cache, kv_layout
    from coinrag.inference.model.loading import load_model
    from coinrag.inference.model.prompt import RagPrompt
    from coinrag.schemas.settings import load_settings
    from coinrag.schemas.tables import ChunkRow
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    store_dir = tmp_path / "store"
    shutil.copytree(built["store"], store_dir)
    # the chained build reuses the store's recorded settings: rules, chunk_size 24
    out = tmp_path / "ft"
    s = train_nuggets(
        store_dir,
        built["data"],
        out,
        mode="frozen",
        max_steps=1,
        model=str(built["model"]),
        build={"extractor": "rules", "chunk_size": 24},
        rebuild_kv=True,
        batch_size=2,
        kc=2,
        k=4,
        lr=1e-2,
    )
    rb = s["kv_rebuild"]
    assert rb["chunks"] > 0 and rb["kv_computed"] == rb["chunks"] and rb["kv_reused"] == 0
    assert rb["chunks_new"] == 0 and rb["extract_requested"] == 0 and rb["llm_calls"] == 0

    store = Store.at(store_dir)
    assert load_settings(store.settings_path).model == str(out)
    new, base = load_model(out), load_model(built["model"])
    prompt = RagPrompt.for_tokenizer(new.tokenizer)
    new_layout, base_layout = kv_layout(new, prompt), kv_layout(base, prompt)
    assert new_layout.kv_fp != base_layout.kv_fp
    new_kv = KvStore.open(store, new_layout.kv_fp, new_layout)
    base_kv = KvStore.open(store, base_layout.kv_fp, base_layout)
    chunk = read_rows(store, ChunkRow, filter=pc.field("n_tokens") > 8)[0]
    stored_new = new_kv.read_entry(chunk.content_key)
    stored_base = base_kv.read_entry(chunk.content_key)  # the old cache is still readable
    assert not torch.equal(stored_new, stored_base)
    # the new entry is what the new model computes itself: forward(prefix + chunk), fp32;
    # tolerance as in the KV oracle tests (1e-5 x max|kv|: a different matmul shape)
    prefix = prompt.prefix_ids
    with torch.inference_mode():
        own = new.model(input_ids=torch.tensor([prefix + list(chunk.token_ids)]), use_cache=True)
    expected = from_cache(own.past_key_values)[..., len(prefix) :, :]
    assert stored_new.shape == expected.shape
    assert (stored_new - expected).abs().max() <= 1e-5 * expected.abs().max()

    engine = RagEngine.open(str(store_dir))  # the store's model now: the fine-tuned one
    assert engine.loaded.model_fp == s["model_fp"]
    assert engine.answer(built["ex"][0].question, method="coinrag", kc=2, k=4).timings["ttft"] > 0


def test_retriever_deployment_constructs():
    from coinrag.flows.deployments import make_retriever_deployment

    dep = make_retriever_deployment("/s", "/o", ["/q.jsonl"], build_deployment="b")
    assert dep.parameters["versioned_out"] is True
    assert dep.triggers[0].match_related.root["prefect.resource.name"] == "b"
    assert dep.triggers[0].match_related.root["prefect.resource.role"] == "deployment"
    assert make_retriever_deployment("/s", "/o", [], cron="0 3 * * *").schedules
    with pytest.raises(ValueError, match="exactly one"):
        make_retriever_deployment("/s", "/o", [])
    with pytest.raises(TypeError, match="lr"):  # not a parameter of the flow
        make_retriever_deployment("/s", "/o", [], cron="0 3 * * *", lr=1e-3)
