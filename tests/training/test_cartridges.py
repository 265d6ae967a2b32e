"""Cartridges (CAS): plumbing oracles, training, mixed visibility, budget, resume, self-study.

Models: small random-weight Llama / Qwen2 configs (``from_config``, 2 layers, hidden 64, the
SmolLM2 vocabulary so that the real chat template and tokenizer are used; ``initializer_range``
0.2 so that the context visibly changes the next-token distribution), and SmolLM2 for one oracle.

Tolerances (float32 on CPU):
- full-document cartridge vs teacher: per-position bucket KL <= KL_ATOL (measured 3e-13 on the
  tiny models, 1.4e-11 on SmolLM2) and |Δ log p| over the teacher's top-k <= LOGP_ATOL: the teacher
  runs batched with padding and incremental decoding, the student one forward over an assembled
  cache, so only float32 rounding differs;
- placement: layer-0 keys of a cartridge placed second vs the model's own keys of the same tokens
  at those positions (layer-0 keys depend only on token and position): <= KEY_ATOL.
"""

from __future__ import annotations

import math
import random
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from fake_openai_server import Action, FakeOpenAI
from store_fixtures import TINY_DIMS
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from coinrag.inference.context.assemble import assemble_cartridges
from coinrag.inference.llm.client import LlmEndpoint, RetryPolicy
from coinrag.inference.methods.cartridge import CartridgeRag, text_rag_answer
from coinrag.inference.model.encode import from_cache, prefix_kv
from coinrag.inference.model.loading import LoadedModel
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import RopeSpec, rerotate_keys
from coinrag.schemas.keys import CODE_VERSION, doc_version
from coinrag.schemas.settings import CartridgeSettings, CartridgeTrainSettings, TeacherSettings
from coinrag.schemas.tables import (
    CartridgeManifestRow,
    DocumentRow,
    ExtractionCallRow,
    RunRow,
    SelfStudyCallRow,
    SelfStudyQuestionRow,
    TeacherAnswerRow,
)
from coinrag.storage.cartridges import (
    CartridgeLayout,
    CartridgeMeta,
    CartridgeStore,
    CorruptCartridge,
    cartridge_id,
)
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_rows
from coinrag.tasks.question_generators.local import LocalQuestionGenerator
from coinrag.tasks.question_generators.openai_chat import OpenAIQuestionGenerator
from coinrag.tasks.questions import call_key, plan_calls, question_id, selfstudy_stage
from coinrag.tasks.teacher import teacher_answers
from coinrag.training.budget import (
    LIVE,
    BudgetExceeded,
    CartridgePool,
    CartridgeTrainer,
    PoolDoc,
    TrainRun,
)
from coinrag.training.cartridges import (
    CartridgeSpec,
    Example,
    Visibility,
    evaluate_kl,
    init_cartridge,
    student_logprobs,
    topk_kl,
)

KL_ATOL = 1e-6
LOGP_ATOL = 1e-4
KEY_ATOL = 1e-5
API_KEY = "sk-test-SECRET-cartridges-0123456789"

DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, named after Gustave Eiffel.",
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas of Nepal.",
    "The Nile is a major north-flowing river in northeastern Africa, ending in the Mediterranean.",
    "Python is a high-level programming language whose design emphasizes code readability.",
    "The Great Wall of China is a series of fortifications built across northern China.",
]
QUESTIONS = ["What is it?", "Where is it located?", "Who is it named after?", "Tell me a fact."]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # faster than 2 on a shared machine
    yield
    torch.set_num_threads(n)


def _tiny(kind: str, vocab: int) -> torch.nn.Module:
    small = dict(
        **TINY_DIMS,
        vocab_size=vocab,
        max_position_embeddings=2048,
        initializer_range=0.2,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = (LlamaConfig if kind == "llama" else Qwen2Config)(**small, rope_parameters=rope)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def tiny(tok):
    return _tiny("llama", len(tok))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _pool(model, tok, prompt, spec, n_docs=4, n_q=3, max_new_tokens=6, tag="test"):
    """A pool of ``n_docs`` documents with teacher examples (in memory); ``tag`` makes the
    cartridge ids unique to one test."""
    docs, examples = {}, []
    for i, text in enumerate(DOCS[:n_docs]):
        ids = _ids(tok, text)
        cid = cartridge_id(f"d{i}", "v1", f"fp-{tag}")
        meta = CartridgeMeta(
            cid, f"d{i}", "v1", f"fp-{tag}", prompt.prefix_sha, spec.tokens_for(len(ids)), spec.init
        )
        docs[cid] = PoolDoc(meta, tuple(ids))
        cfg = TeacherSettings(max_new_tokens=max_new_tokens, batch_size=4)
        outs = teacher_answers(model, tok, prompt, ids, QUESTIONS[:n_q], cfg)
        for j, (q, o) in enumerate(zip(QUESTIONS[:n_q], outs, strict=True)):
            examples.append(
                Example(
                    f"e{i}-{j}",
                    cid,
                    tuple(prompt.query_ids(q)),
                    tuple(o.answer_ids),
                    o.topk_ids,
                    o.topk_logprobs,
                )
            )
    return docs, examples


def _trainer(store, model, prompt, docs, examples, spec, config, key="tk"):
    cstore = CartridgeStore.create(store, CartridgeLayout.for_model(model, "model-tiny"))
    return CartridgeTrainer(
        model,
        prompt,
        RopeSpec.from_config(model.config),
        CartridgePool(cstore, docs, spec),
        examples,
        config,
        TrainRun("run-test", key),
    )


# ---------------------------------------------------------------------------- oracles


def _check_full_doc_oracle(model, tok, doc: str, questions, max_new_tokens: int) -> float:
    prompt = RagPrompt.for_tokenizer(tok)
    rope = RopeSpec.from_config(model.config)
    ids = _ids(tok, doc)
    cfg = TeacherSettings(max_new_tokens=max_new_tokens, batch_size=len(questions))
    outs = teacher_answers(model, tok, prompt, ids, questions, cfg)
    z = init_cartridge(model, prompt, rope, ids, p=len(ids))  # p = document length
    ctx = assemble_cartridges(prefix_kv(model, prompt), [z], rope)
    worst = 0.0
    with torch.no_grad():
        for q, o in zip(questions, outs, strict=True):
            logp = student_logprobs(model, ctx, prompt.query_ids(q), o.answer_ids)
            kl = topk_kl(logp, o.topk_ids, o.topk_logprobs)
            assert float(kl.abs().max()) <= KL_ATOL, float(kl.abs().max())
            diff = (logp.gather(-1, o.topk_ids) - o.topk_logprobs).abs().max()
            assert float(diff) <= LOGP_ATOL, float(diff)
            # the student's greedy choice is the teacher's answer token at every position
            assert logp.argmax(-1).tolist() == list(o.answer_ids)
            worst = max(worst, float(kl.abs().max()))
    return worst


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_full_document_cartridge_reproduces_teacher(tok, kind) -> None:
    model = _tiny(kind, len(tok))
    _check_full_doc_oracle(model, tok, DOCS[0], QUESTIONS[:3], max_new_tokens=8)


@pytest.mark.slow
def test_full_document_cartridge_reproduces_teacher_smollm2() -> None:
    from coinrag.inference.model.loading import load_model

    loaded = load_model(None)
    _check_full_doc_oracle(loaded.model, loaded.tokenizer, DOCS[1], QUESTIONS[:2], 6)


def test_cartridge_placed_second_equals_first_after_rotation(tok, tiny) -> None:
    prompt = RagPrompt.for_tokenizer(tok)
    rope = RopeSpec.from_config(tiny.config)
    a_ids, b_ids = _ids(tok, DOCS[0]), _ids(tok, DOCS[1])
    za = init_cartridge(tiny, prompt, rope, a_ids, p=len(a_ids))
    zb = init_cartridge(tiny, prompt, rope, b_ids, p=len(b_ids))
    c_p = prefix_kv(tiny, prompt)
    n, pa = prompt.n_prefix, len(a_ids)
    first = assemble_cartridges(c_p, [zb], rope)[0, 0][..., n : n + len(b_ids), :]
    second = assemble_cartridges(c_p, [za, zb], rope)[0, 0][..., n + pa :, :]
    # 1. second == Rot(first; +pa)
    moved = rerotate_keys(first, range(n, n + len(b_ids)), range(n + pa, n + pa + len(b_ids)), rope)
    assert float((second - moved).abs().max()) <= KEY_ATOL
    # 2. ... == the model's own layer-0 keys of b's tokens at those positions
    with torch.no_grad():
        out = tiny(input_ids=torch.tensor([prompt.prefix_ids + a_ids + b_ids]), use_cache=True)
    own = from_cache(out.past_key_values)[0, 0][..., n + pa :, :]
    assert float((second - own).abs().max()) <= KEY_ATOL
    assert float((first - own).abs().max()) > 1e-2  # not trivially equal: positions matter


# ---------------------------------------------------------------------------- training


def test_training_lowers_kl_only_cartridges_learn_first_token_frozen(tok, tiny, tmp_path) -> None:
    prompt = RagPrompt.for_tokenizer(tok)
    spec = CartridgeSpec(p=4)
    docs, examples = _pool(tiny, tok, prompt, spec, n_docs=2, n_q=4)
    cfg = CartridgeTrainSettings(lr=1e-1, budget=2, rotate_every=50, p_iso=1.0)
    trainer = _trainer(Store.at(tmp_path).init(), tiny, prompt, docs, examples, spec, cfg)
    rope = trainer.rope
    init = trainer.cartridges()
    before = evaluate_kl(tiny, trainer.prefix, rope, init, examples)
    report = trainer.run(48)
    after_z = trainer.cartridges()
    after = evaluate_kl(tiny, trainer.prefix, rope, after_z, examples)
    assert after < 0.75 * before, (before, after)  # measured: 0.57x
    assert all(not p.requires_grad and p.grad is None for p in tiny.parameters())
    for cid in docs:
        assert torch.equal(after_z[cid][..., 0, :], init[cid][..., 0, :])  # first token frozen
        assert not torch.equal(after_z[cid][..., 1:, :], init[cid][..., 1:, :])
    assert report.steps == 48 and len(report.final_rows) == 2


def test_mixed_visibility_matches_its_distribution() -> None:
    vis = Visibility(p_iso=0.3, k_min=1, k_max=3)
    pool = [f"c{i}" for i in range(10)]
    rng = random.Random(7)
    n = 20000
    ks: Counter[int] = Counter()
    slot: Counter[tuple[int, int]] = Counter()
    iso = 0
    for _ in range(n):
        own = pool[rng.randrange(10)]
        seen = vis.sample(own, pool, rng)
        assert seen.count(own) == 1 and len(set(seen)) == len(seen)
        if len(seen) == 1:
            iso += 1
        else:
            ks[len(seen) - 1] += 1
            slot[(len(seen), seen.index(own))] += 1
    sigma = math.sqrt(n * 0.3 * 0.7)
    assert abs(iso - 0.3 * n) <= 4 * sigma
    mixed = n - iso
    chi2 = sum((ks[k] - mixed / 3) ** 2 / (mixed / 3) for k in (1, 2, 3))
    assert chi2 < 13.8  # chi-square, 2 dof, p = 0.001
    for size in (2, 3, 4):  # the own cartridge's slot is uniform
        total = sum(slot[(size, i)] for i in range(size))
        chi2 = sum((slot[(size, i)] - total / size) ** 2 / (total / size) for i in range(size))
        assert chi2 < 16.3  # <= 3 dof, p = 0.001
    assert vis.sample("c0", ["c0"], rng) == ["c0"]  # no distractor available


def test_budget_never_exceeds_b_and_roundtrips_bit_exact(tok, tiny, tmp_path) -> None:
    prompt = RagPrompt.for_tokenizer(tok)
    spec = CartridgeSpec(p=3)
    docs, examples = _pool(tiny, tok, prompt, spec, 5, 2, 4, tag="budget")
    cfg = CartridgeTrainSettings(lr=5e-2, budget=2, rotate_every=2, p_iso=0.5, k_min=1, k_max=2)
    store = Store.at(tmp_path).init()
    trainer = _trainer(store, tiny, prompt, docs, examples, spec, cfg)
    live_max = 0

    def check(step: int, loss: float) -> None:
        nonlocal live_max
        live = [c for c in LIVE if c.cartridge_id in docs]
        live_max = max(live_max, len(live))
        assert len(trainer.manager.resident) <= 2

    report = trainer.run(14, on_step=check)
    assert live_max <= 2 and report.peak_resident == 2
    assert report.rotations >= 5 and report.evictions >= 8  # it did rotate through the pool
    # device bytes of the resident pool = 2 cartridges x (param + grad-free + 2 moments)
    nb = trainer.manager.device_bytes()
    assert nb["param"] == 2 * tiny.config.num_hidden_layers * 2 * 2 * 16 * 3 * 4
    with pytest.raises(BudgetExceeded):
        trainer.manager.load(next(c for c in docs if c not in trainer.manager.resident))
    # the stored final versions are the in-memory values, bit for bit
    current = trainer.cartridges()
    cstore = trainer.cstore
    for row in report.final_rows:
        assert torch.equal(cstore.read(row), current[row.cartridge_id])
    # bf16 round trip, bit-exact (stored as uint16)
    bstore = CartridgeStore.create(
        Store.at(tmp_path / "b").init(), CartridgeLayout("m-bf16", 2, 2, 16, "bfloat16")
    )
    meta = CartridgeMeta("ct-bf", "d", "v", "fp", "ps", 5, "random_text")
    x = (torch.randn(2, 2, 2, 5, 16) * 3).to(torch.bfloat16)
    (row,) = bstore.write([(meta, x)], step=0, kind="final", run_id="r")
    assert torch.equal(bstore.read(row).view(torch.int16), x.view(torch.int16))
    # a flipped byte is caught
    data = next(p for p in bstore.path_of(row.location).rglob("*") if p.is_file() and p.name == "0")
    raw = bytearray(data.read_bytes())
    raw[3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCartridge):
        bstore.read(row)
    manifest = read_rows(store, CartridgeManifestRow)
    assert {r.kind for r in manifest} >= {"rotation", "final"}


def test_resume_after_kill_gives_the_same_losses(tok, tiny, tmp_path) -> None:
    prompt = RagPrompt.for_tokenizer(tok)
    spec = CartridgeSpec(p=3)
    docs, examples = _pool(tiny, tok, prompt, spec, n_docs=4, n_q=2, max_new_tokens=4)
    cfg = CartridgeTrainSettings(
        lr=5e-2, budget=2, rotate_every=3, checkpoint_every=4, p_iso=0.5, k_min=1, k_max=2
    )
    full = _trainer(Store.at(tmp_path / "a").init(), tiny, prompt, docs, examples, spec, cfg)
    uninterrupted = full.run(16)

    class Killed(Exception):
        pass

    def kill(step: int, loss: float) -> None:
        if step == 10:
            raise Killed

    store = Store.at(tmp_path / "b").init()
    with pytest.raises(Killed):
        _trainer(store, tiny, prompt, docs, examples, spec, cfg).run(16, on_step=kill)
    resumed = _trainer(store, tiny, prompt, docs, examples, spec, cfg).run(16)
    assert resumed.resumed_from == 8  # the last checkpoint before the kill
    assert resumed.losses == uninterrupted.losses  # bit-identical, from step 9 on as well
    a = {r.cartridge_id: full.cstore.read(r) for r in uninterrupted.final_rows}
    for row in resumed.final_rows:
        assert torch.equal(CartridgeStore.open(store, "model-tiny").read(row), a[row.cartridge_id])
    again = _trainer(store, tiny, prompt, docs, examples, spec, cfg).run(16)
    assert again.resumed_from == 16 and again.losses == uninterrupted.losses


# ---------------------------------------------------------------------------- self-study


def _documents(store: Store, n: int) -> list[DocumentRow]:
    rows = [
        DocumentRow(
            doc_id=f"doc{i}",
            doc_version=doc_version(DOCS[i], {}),
            text=DOCS[i],
            metadata_json="{}",
            source="test",
            n_chars=len(DOCS[i]),
            run_id="build-20260101T000000-00000000",
            code_version=CODE_VERSION,
        )
        for i in range(n)
    ]
    append_rows(store, rows, "build-20260101T000000-00000000", "ingest")
    return rows


def test_plan_calls_is_seeded_and_proportional_to_length() -> None:
    short = DocumentRow("a", "va", "x " * 500, "{}", "t", 1000, "r", CODE_VERSION)
    long_ = DocumentRow("b", "vb", "y " * 1500, "{}", "t", 3000, "r", CODE_VERSION)
    plan = plan_calls([short, long_], seed=3, n_calls=402)
    assert plan == plan_calls([long_, short], seed=3, n_calls=402)
    n_long = sum(p.doc_id == "b" for p in plan)
    assert abs((n_long - 1) / 400 - 0.75) < 0.07  # 1 guaranteed each, the rest ~ length
    keys = {(p.text_hash, p.seed_type, p.call_index) for p in plan}
    assert len(keys) == len(plan)  # every call has its own cache key


def test_local_generator_from_settings_takes_their_device_and_sizes() -> None:
    """The settings' device reaches the generator (a model given by reference loads there),
    with their question count and batch size; nothing is loaded yet."""
    settings = CartridgeSettings(device="cuda", n_questions=3, local_batch_size=2)
    gen = LocalQuestionGenerator.from_settings(settings, "smollm2")
    assert (gen.device, gen.n_questions, gen.batch_size, gen.model) == ("cuda", 3, 2, "smollm2")
    assert gen._loaded is None


def test_local_generator_yields_parseable_arrays_or_counted_drops(tok, tiny, tmp_path) -> None:
    loaded = LoadedModel(tiny, tok, Path(tmp_path), "model-tiny", "tok-test")
    gen = LocalQuestionGenerator(
        loaded, n_questions=3, min_question_tokens=2, max_question_tokens=6, batch_size=2
    )
    store = Store.at(tmp_path).init()
    docs = _documents(store, 3)
    questions, counts = selfstudy_stage(
        store, docs, gen, run_id="selfstudy-test", settings=CartridgeSettings(seed=1)
    )
    assert counts.planned == 3 and counts.ok == 3 and counts.malformed == counts.failed == 0
    assert counts.raw_items == 9  # the skeleton always parses into n strings
    assert counts.questions + counts.dropped_items == 9
    assert sum(counts.drop_reasons.values()) == counts.dropped_items
    assert len(questions) == counts.questions
    assert all(q.text.endswith("?") for q in questions)
    calls = read_rows(store, SelfStudyCallRow)
    assert [c.status for c in calls] == ["ok"] * 3
    assert len(read_rows(store, ExtractionCallRow)) == 3
    again, counts2 = selfstudy_stage(
        store, docs, gen, run_id="selfstudy-test2", settings=CartridgeSettings(seed=1)
    )
    assert counts2.cached == 3 and counts2.ledger_rows == 0 and again == questions


def test_selfstudy_plans_with_the_cartridge_settings(tok, tiny, tmp_path) -> None:
    """The stage's plan is ``plan_calls`` with the settings' seed, n_calls and chars_per_call."""
    loaded = LoadedModel(tiny, tok, Path(tmp_path), "model-tiny", "tok-test")
    gen = LocalQuestionGenerator(loaded, n_questions=2, max_question_tokens=6, batch_size=2)
    store = Store.at(tmp_path).init()
    docs = _documents(store, 2)
    settings = CartridgeSettings(seed=2, n_calls=3, chars_per_call=10)
    _, counts = selfstudy_stage(store, docs, gen, run_id="selfstudy-plan", settings=settings)
    plan = plan_calls(docs, seed=2, n_calls=3, chars_per_call=10)
    assert counts.planned == len(plan) == 3
    calls = {c.call_key: c for c in read_rows(store, SelfStudyCallRow)}
    by_key = {call_key(gen.fingerprint, p): p for p in plan}
    assert set(calls) == set(by_key)
    for key, c in calls.items():  # each call row carries its plan's columns
        p = by_key[key]
        assert (c.doc_id, c.doc_version, c.text_hash, c.seed_type) == (
            p.doc_id,
            p.doc_version,
            p.text_hash,
            p.seed_type,
        )
        assert (c.char_start, c.char_end, c.call_index) == (p.char_start, p.char_end, p.call_index)
        assert (c.generator_fp, c.backend, c.run_id) == (gen.fingerprint, "local", "selfstudy-plan")
    for q in read_rows(store, SelfStudyQuestionRow):  # and each question its call's
        c = calls[q.call_key]
        assert (q.doc_id, q.doc_version, q.seed_type) == (c.doc_id, c.doc_version, c.seed_type)
        assert q.question_id == question_id(q.call_key, q.ordinal) and q.run_id == c.run_id


def test_openai_generator_against_fake_server(tmp_path) -> None:
    store = Store.at(tmp_path).init()
    docs = _documents(store, 3)
    good = '["Where is the Eiffel Tower?", "Who was Gustave Eiffel?", "Eiffel?", 7]'
    with FakeOpenAI(api_key=API_KEY) as fake:
        # request order = plan order (concurrency 1): doc0, doc1, doc2
        fake.script_chat(
            Action.raw_content(good),
            Action.error(500, "boom"),
            Action.raw_content('["Where is Mount Everest?", "How high is Everest?"]'),
            Action.raw_content('["cut off'),
        )
        endpoint = LlmEndpoint(
            "gpt-4o-mini",
            base_url=fake.base_url,
            api_key=API_KEY,
            timeout_s=120.0,
            retry=RetryPolicy(sleep=lambda s: None),
        )
        gen = OpenAIQuestionGenerator(endpoint, n_questions=4, concurrency=1)
        questions, counts = selfstudy_stage(
            store, docs, gen, run_id="selfstudy-oa", settings=CartridgeSettings(seed=0)
        )
        n_requests = len(fake.chat_requests())
        body = fake.chat_requests()[0].json
        again, counts2 = selfstudy_stage(
            store, docs, gen, run_id="selfstudy-oa2", settings=CartridgeSettings(seed=0)
        )
        assert len(fake.chat_requests()) == n_requests  # cached: no call
    assert n_requests == 4 and counts.ok == 2 and counts.malformed == 1
    assert counts.raw_items == 6 and counts.questions == 4
    assert counts.drop_reasons == {"too_short": 1, "not_string": 1}
    assert "JSON array" in body["messages"][1]["content"]
    assert "Eiffel" in body["messages"][0]["content"]
    assert counts2.cached == 3 and again == questions
    ledger = read_rows(store, ExtractionCallRow)
    assert sorted(c.status for c in ledger) == ["malformed", "ok", "ok", "server_error"]
    assert all(c.backend == "selfstudy-openai" for c in ledger)
    dump = "".join(str(r) for r in ledger + read_rows(store, SelfStudyCallRow))
    assert API_KEY not in dump


# ---------------------------------------------------------------------------- flow and serving


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_train_flow_then_cartridge_rag(tok, tmp_path, monkeypatch) -> None:
    from coinrag.flows.cartridges import train_cartridges

    model_dir = Path(tempfile.mkdtemp(dir=tmp_path))
    _tiny("qwen2", len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    store = Store.at(tmp_path / "store").init()
    _documents(store, 3)
    fake = FakeOpenAI(api_key=API_KEY).start()
    # one answer per call (3 documents, 1 call each); each question shares a word with each doc
    answer = '["Which tower, mountain or river is it?", "Where is the tower, mountain or river?"]'
    fake.script_chat(*[Action.raw_content(answer)] * 3)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the default generator is then openai
    settings = dict(
        model=str(model_dir),
        base_url=fake.base_url,
        n_questions=2,
        max_new_tokens=4,
        p=3,
        budget=2,
        rotate_every=2,
        checkpoint_every=3,
        p_iso=0.5,
    )
    try:
        first = train_cartridges(store.root, None, 5, **settings)
        second = train_cartridges(store.root, None, 5, **settings)
        assert len(fake.chat_requests()) == 3
    finally:
        fake.stop()
    assert first["documents"] == 3 and first["questions"] == 6
    assert first["training"]["steps"] == 5 and first["training"]["examples"] == 6
    assert first["training"]["peak_resident"] == 2
    assert second["selfstudy"]["cached"] == 3 and second["selfstudy"]["ledger_rows"] == 0
    assert second["teacher"]["answered"] == 0
    assert second["training"]["resumed_from"] == 5
    runs = {(r.flow, r.status) for r in read_rows(store, RunRow)}
    assert ("train-cartridges", "completed") in runs
    assert read_rows(store, TeacherAnswerRow)

    from coinrag.inference.model.loading import load_model

    loaded = load_model(str(model_dir))
    rag = CartridgeRag(store, loaded)
    assert rag.doc_ids == ["doc0", "doc1", "doc2"]

    class Retriever:
        def documents(self, question, k, mode=None):
            return [{"doc_id": "doc2"}, {"doc_id": "doc0"}][:k]

    rag.retriever = Retriever()
    ans = rag.answer("Where is it?", k=2, max_new_tokens=3)
    assert ans.doc_ids == ["doc2", "doc0"] and len(ans.cartridge_ids) == 2
    assert ans.context_tokens == rag.prompt.n_prefix + 2 * 3
    assert ans.prompt_tokens == ans.context_tokens + len(rag.prompt.query_ids("Where is it?"))
    oracle = rag.oracle("Where is it?", "doc1", max_new_tokens=3)
    assert oracle.context_tokens == rag.prompt.n_prefix + 3
    text = text_rag_answer(
        loaded, rag.prompt, [_ids(tok, DOCS[2]), _ids(tok, DOCS[0])], "Where is it?"
    )
    assert text.context_tokens == rag.prompt.n_prefix + len(_ids(tok, DOCS[2])) + len(
        _ids(tok, DOCS[0])
    )
