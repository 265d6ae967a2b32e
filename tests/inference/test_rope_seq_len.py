"""RoPE whose frequencies depend on the forward's length (dynamic NTK, longrope), against
transformers' own forward.

transformers picks these frequencies per forward from its length ``max(position_ids) + 1``
(``modeling_rope_utils.dynamic_rope_update``): dynamic NTK recomputes them above
``max_position_embeddings`` and keeps the grown ones for later forwards up to the grown length;
longrope switches to its long factors above ``original_max_position_embeddings``. Hence two
defects this file holds fixed (issue 13, item 5): a right-padded KV batch gave its shorter chunks
the frequencies of the longest one, and a grown dynamic module leaked into the next forward (the
next KV batch, the next query of a ``RagEngine``); and the assembled context kept ``C_p`` at the
frequencies of a ``|p|``-token forward when the context plus query crosses the threshold.

Oracle: the model's own forward over the same tokens at the same positions, run with a newly
constructed rotary embedding (``type(rotary)(config)``: the state of a freshly loaded model,
independent of ``inference.rope.reset_rotary``).

Tolerances:
- a KV entry computed in a batch of its own equals the chunk encoded alone bit for bit (the same
  forward); rows of a multi-row batch within ``KV_REL`` (1e-5 of max|kv|, float32: other matmul
  shapes round differently; the rule of ``tests/inference/test_kv_store.py``);
- layer-0 keys of an assembled context: ``FP32_RTOL`` 1e-5 and ``BF16_RTOL`` 8 * 2**-8 of
  max|k|, derived in ``tests/inference/test_rope_oracle.py`` (float32 rounding of the rotation; bf16
  rotation error bound);
- a query prefill after an earlier, longer one equals the same prefill in a fresh model bit for
  bit (the same forward).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from store_fixtures import TINY_DIMS, sample_docs, save_tiny_llama, synthetic_chunk, write_corpus
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.model.encode import KvBatching, compute_prefix_kv
from coinrag.inference.model.generate import prefill_and_decode
from coinrag.inference.model.kv_pipeline import compute_group_kv
from coinrag.inference.model.loading import LoadedModel, tokenizer_fingerprint
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import ForwardFrequencies, RopeSpec, reset_rotary
from coinrag.schemas.keys import fingerprint
from coinrag.storage.kv import KvStore
from coinrag.storage.store import Store
from coinrag.tasks.kv import KvOptions, kv_stage

FP32_RTOL = 1e-5
BF16_RTOL = 8 * 2**-8
KV_REL = 1e-5
THRESHOLD = 64  # max_position_embeddings (dynamic) / original_max_position_embeddings (longrope)
VOCAB = 500
ARCHS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": lambda **kw: Qwen3Config(head_dim=16, **kw),
}


def _rope(kind: str, threshold: int = THRESHOLD) -> dict:
    if kind == "dynamic":
        return dict(
            max_position_embeddings=threshold,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        )
    if kind == "longrope":  # head dim 16: 8 factors each
        return dict(
            max_position_embeddings=4 * threshold,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0],
                "original_max_position_embeddings": threshold,
            },
        )
    return dict(
        max_position_embeddings=4 * threshold,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _model(arch: str, kind: str, dtype=torch.float32, vocab: int = VOCAB, threshold=THRESHOLD):
    torch.manual_seed(0)
    config = ARCHS[arch](**TINY_DIMS, vocab_size=vocab, **_rope(kind, threshold))
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunk(i: int, token_ids: list[int]):
    return dataclasses.replace(
        synthetic_chunk(i, len(token_ids)), token_ids=token_ids, content_key=f"ck-{i:04d}"
    )


def _fresh(model):
    """``model`` with a newly constructed rotary embedding, as a freshly loaded model has."""
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model


def _alone(model, prefix: list[int], ids: list[int]) -> torch.Tensor:
    """The model's own cache of ``ids`` after ``prefix`` (prefix forward, then the chunk with
    it as past), each forward fresh: ``(layers, 2, kv_heads, n, head_dim)``."""
    with torch.inference_mode():
        past = _fresh(model).model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
        cache = (
            _fresh(model)
            .model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
            .past_key_values
        )
    p = len(prefix)
    return torch.stack(
        [torch.stack([lay.keys[0, :, p:], lay.values[0, :, p:]]) for lay in cache.layers]
    )


def _layer0_keys(model, ids: list[int]) -> torch.Tensor:
    """Layer-0 keys ``(kv_heads, n, head_dim)`` of one forward over ``ids`` at 0.., fresh."""
    with torch.inference_mode():
        cache = _fresh(model).model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    return cache.layers[0].keys[0]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------------------- which frequencies


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "default"])
def test_frequency_key_is_what_transformers_uses(kind: str) -> None:
    """Equal keys <=> a fresh rotary embedding runs forwards of those lengths with equal
    ``inv_freq`` (read from the module after the forward)."""
    model = _model("llama", kind)
    freqs = ForwardFrequencies.from_config(model.config)
    assert freqs.seq_len_dependent == (kind != "default")
    seen = {}
    for n in [1, 30, 63, 64, 65, 66, 80, 85, 200]:
        rotary = type(model.model.rotary_emb)(model.config)
        x = torch.zeros(1, n, 8)
        rotary(x, torch.arange(n)[None])
        seen[n] = rotary.inv_freq.clone()
    for a in seen:
        for b in seen:
            assert (freqs.key(a) == freqs.key(b)) == torch.equal(seen[a], seen[b]), (a, b)


def test_reset_rotary_restores_a_fresh_module() -> None:
    model = _model("llama", "dynamic")
    fresh = copy.deepcopy(model.model.rotary_emb)
    x = torch.zeros(1, 1, 8)
    model.model.rotary_emb(x, torch.arange(100)[None])  # grows to 100
    cos_grown, _ = model.model.rotary_emb(x, torch.arange(75)[None])  # stays at 100
    cos_fresh, _ = copy.deepcopy(fresh)(x, torch.arange(75)[None])
    assert not torch.equal(cos_grown, cos_fresh)  # transformers' carry-over
    reset_rotary(model)
    cos_reset, _ = model.model.rotary_emb(x, torch.arange(75)[None])
    assert torch.equal(cos_reset, cos_fresh)


# ---------------------------------------------------------------------------- the KV stage


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_chunks_get_the_keys_they_get_alone(arch: str, kind: str) -> None:
    """Issue 13's case: prefix 5 tokens, chunks of 80, 70 and 30 tokens asked for in one batch
    of 4, threshold 64. Each entry equals the chunk encoded alone: bit for bit in a batch of
    its own (dynamic: all three; longrope: the 30), else within ``KV_REL``."""
    model = _model(arch, kind)
    prefix = _ids(5, 1)
    chunks = [_chunk(i, _ids(n, 10 + i)) for i, n in enumerate([80, 70, 30])]
    prefix_kv = compute_prefix_kv(model, prefix)
    got = compute_group_kv(model, prefix_kv, chunks, batch_size=4)
    batches = KvBatching.for_model(model, 5, 4).split(chunks)
    assert [[c.n_tokens for c in b] for b in batches] == (
        [[80], [70], [30]] if kind == "dynamic" else [[80, 70], [30]]
    )
    own_batch = {b[0].chunk_id for b in batches if len(b) == 1}
    for chunk, kv in got:
        alone = _alone(model, prefix, chunk.token_ids)
        if chunk.chunk_id in own_batch:
            assert torch.equal(kv, alone), (chunk.n_tokens, _rel(kv[0, 0], alone[0, 0]))
        else:
            assert _rel(kv, alone) <= KV_REL
            assert torch.equal(kv[0, 0], alone[0, 0])  # layer-0 keys: no matmul over rows
    # The case exercises the defect: one padded forward of the three (what the stage did)
    # gives the 30-token chunk other layer-0 keys (observed 0.59-0.78 dynamic, 1.6 longrope).
    padded = torch.tensor([c.token_ids + [0] * (80 - c.n_tokens) for c in chunks])
    one = _fresh(model)
    with torch.inference_mode():
        past = one.model(input_ids=torch.tensor([prefix] * 3), use_cache=True).past_key_values
        keys = one.model(input_ids=padded, past_key_values=past).past_key_values.layers[0].keys
    assert _rel(keys[2, :, 5:35], got[2][1][0, 0]) > 0.1


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "default"])
def test_kv_stage_batches_only_chunks_with_the_same_frequencies(
    tmp_path: Path, smollm2_tokenizer, kind: str
) -> None:
    """Through the stage and the store: with the real prompt prefix ``p`` and the threshold at
    ``|p| + 64``, chunks of 80, 80, 70, 30, 20 tokens in batches of 4 are computed as [80, 80],
    [70], [30, 20] (dynamic: one frequency set per length above the threshold), [80, 80, 70],
    [30, 20] (longrope: short or long) or [80, 80, 70, 30], [20] (default); every entry is the
    model's own cache of the chunk alone."""
    prompt = RagPrompt.for_tokenizer(smollm2_tokenizer)
    p = prompt.n_prefix
    vocab = len(smollm2_tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_DIMS, vocab_size=vocab, **_rope(kind, p + THRESHOLD))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tok_fp = tokenizer_fingerprint(smollm2_tokenizer)
    loaded = LoadedModel(
        model, smollm2_tokenizer, Path("."), fingerprint("model", {"t": kind}), tok_fp
    )
    chunks = [
        dataclasses.replace(_chunk(i, _ids(n, 20 + i, vocab)), tokenizer_fp=tok_fp)
        for i, n in enumerate([80, 80, 70, 30, 20])
    ]
    store = Store.at(tmp_path / "store").init()
    counts = kv_stage(
        store, chunks, loaded, prompt, "run-1", KvOptions(batch_size=4, slots_per_shard=5)
    )
    expected = {"default": (2, 10 + 50), "dynamic": (3, 10), "longrope": (2, 10 + 10)}[kind]
    assert (counts.forward_passes, counts.padded_tokens) == expected
    kv = KvStore.open(store, counts.kv_fp)
    for chunk in chunks:
        got = kv.read_entry(chunk.content_key)
        alone = _alone(model, prompt.prefix_ids, chunk.token_ids)
        diff = (got - alone).abs().max().item()
        assert diff <= KV_REL * alone.abs().max().item(), (chunk.n_tokens, diff)
        if kind == "dynamic" and chunk.n_tokens == 70:  # a batch of its own: the same forward
            assert torch.equal(got, alone)


def test_kv_batching_refuses_nothing_for_static_rope() -> None:
    """Position-independent RoPE keeps plain batches of ``batch_size``."""
    batching = KvBatching(4, 5, ForwardFrequencies((("default", None),)))
    group = [synthetic_chunk(i, n) for i, n in enumerate([512, 512, 300, 40, 8])]
    assert [len(b) for b in batching.split(group)] == [4, 1]


# ---------------------------------------------------------------------------- load time


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_assembled_context_across_the_threshold_is_the_models_own(
    arch: str, kind: str, dtype: torch.dtype
) -> None:
    """Slices of chunks encoded below (30 tokens) and above (80 tokens) the threshold, put in
    a context that with the query crosses it: every layer-0 key of the assembled context, the
    prefix's included, equals the key of the model's own forward over prefix + slices + query."""
    model = _model(arch, kind, dtype)
    spec = RopeSpec.from_config(model.config)
    prefix, a, b, query = _ids(5, 1), _ids(80, 2), _ids(30, 3), _ids(12, 4)
    prefix_kv = compute_prefix_kv(model, prefix)
    (_, kv_a), (_, kv_b) = compute_group_kv(model, prefix_kv, [_chunk(0, a), _chunk(1, b)], 4)
    p = len(prefix)
    pieces = [(kv_a, a, 30, 55, 80), (kv_b, b, 0, 30, 30)]  # (kv, ids, start, end, chunk len)
    slices = [KvSlice(kv[..., s:e, :], p + s, p + n) for kv, _, s, e, n in pieces]
    total = p + sum(e - s for *_, s, e, _ in pieces)  # 60 <= 64 < 72 = total + query
    ctx = assemble_context(prefix_kv, slices, spec, new_seq_len=total + len(query))
    tokens = prefix + [t for _, ids, s, e, _ in pieces for t in ids[s:e]] + query
    ref = _layer0_keys(model, tokens)[:, :total]
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    assert ctx.dtype == dtype
    assert _rel(ctx[0, 0, :, :p], ref[:, :p]) <= tol  # C_p, moved to the long frequencies
    assert _rel(ctx[0, 0], ref) <= tol


def test_a_query_prefill_forgets_the_previous_query(smollm2_tokenizer) -> None:
    """Dynamic NTK: a 100-token prefill grows the frequencies; the next, 75-token prefill (in
    (64, 100]) gets the logits a freshly loaded model gives it, bit for bit."""
    model = _model("llama", "dynamic", vocab=len(smollm2_tokenizer))
    vocab = len(smollm2_tokenizer)
    long, short = _ids(100, 5, vocab), _ids(75, 6, vocab)
    kw = dict(max_new_tokens=4, keep_first_logits=True)
    prefill_and_decode(model, smollm2_tokenizer, None, 0, long, **kw)
    after = prefill_and_decode(model, smollm2_tokenizer, None, 0, short, **kw)
    fresh = prefill_and_decode(_fresh(model), smollm2_tokenizer, None, 0, short, **kw)
    assert torch.equal(after.first_logits, fresh.first_logits)
    assert after.token_ids == fresh.token_ids


# ---------------------------------------------------------------------------- SmolLM2 weights


@pytest.fixture(scope="module")
def smollm2_fp32():
    from coinrag.inference.model.loading import load_model

    return load_model(None).model


def _smollm2_with(base, kind: str):
    """SmolLM2-135M's real weights under a seq-len dependent RoPE config (threshold 64), as a
    user extending its context would configure it (head dim 64: 32 longrope factors)."""
    config = copy.deepcopy(base.config)
    rope = _rope(kind)
    if kind == "longrope":
        params = rope["rope_parameters"]
        params["short_factor"] = [1.0 + i / 32 for i in range(32)]
        params["long_factor"] = [float(min(2**i, 8)) for i in range(32)]
    config.max_position_embeddings = rope["max_position_embeddings"]
    config.rope_parameters = {**rope["rope_parameters"], "rope_theta": 100000.0}
    # The same weights; the rotary embedding (the only user of the rope config) built anew from
    # the config, as from_config would (which spends ~8 s on a random init first).
    model = copy.deepcopy(base)
    model.config = model.model.config = config
    return _fresh(model)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_smollm2_batches_and_assembly_across_the_threshold(smollm2_fp32, kind: str) -> None:
    """The two claims above on real weights: the issue's batch (prefix 5, chunks of 80 and 30
    tokens) gives each chunk its own keys, and an assembled context that crosses the threshold
    has the layer-0 keys of the model's own forward."""
    model = _smollm2_with(smollm2_fp32, kind)
    spec = RopeSpec.from_config(model.config)
    vocab = model.config.vocab_size
    prefix, a, b, query = (
        _ids(5, 1, vocab),
        _ids(80, 2, vocab),
        _ids(30, 3, vocab),
        _ids(9, 4, vocab),
    )
    prefix_kv = compute_prefix_kv(model, prefix)
    got = compute_group_kv(model, prefix_kv, [_chunk(0, a), _chunk(1, b)], batch_size=4)
    for (chunk, kv), ids in zip(got, [a, b], strict=True):
        assert torch.equal(kv, _alone(model, prefix, ids)), chunk.n_tokens
    p = len(prefix)
    slices = [KvSlice(got[0][1][..., 20:50, :], p + 20, p + 80), KvSlice(got[1][1], p, p + 30)]
    total = p + 30 + 30  # 65 > 64 already; + query = 74
    ctx = assemble_context(prefix_kv, slices, spec, new_seq_len=total + len(query))
    ref = _layer0_keys(model, prefix + a[20:50] + b + query)[:, :total]
    assert _rel(ctx[0, 0], ref) <= FP32_RTOL


# ---------------------------------------------------------------------------- a RagEngine


@pytest.mark.usefixtures("prefect_harness")
def test_rag_engine_answers_do_not_depend_on_earlier_queries(
    tmp_path: Path, smollm2_tokenizer, sample_corpus: Path
) -> None:
    """Where users meet it: one engine answers many questions (``coinrag eval``). With dynamic
    NTK (threshold 64), a query over 4 chunks grows the frequencies past the length of a query
    over 2 chunks; that query must still be answered as by a fresh engine."""
    from coinrag.flows.build import build_flow
    from coinrag.inference.methods import RagEngine

    model_dir = save_tiny_llama(tmp_path / "model", smollm2_tokenizer, 7, **_rope("dynamic"))
    source = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    store = tmp_path / "store"
    settings = {"extractor": "rules", "model": str(model_dir), "chunk_size": 48}
    build_flow(str(source), str(store), settings)
    engine = RagEngine.open(str(store), max_new_tokens=4)
    # Observe the logits of every model call (the first of an answer is its query prefill):
    # a random tiny model's greedy tokens barely depend on the context, its logits do.
    calls: list[torch.Tensor] = []
    hook = engine.model.lm_head.register_forward_hook(lambda m, a, out: calls.append(out[0, -1]))
    question = "Who directed 2001: A Space Odyssey?"

    def prefill_logits(method: str, kc: int, k: int):
        calls.clear()
        answer = engine.answer(question, method, kc=kc, k=k)
        return answer, calls[0].clone()

    try:
        for method in ("turborag", "coinrag", "standard"):
            small, logits = prefill_logits(method, 2, 4)
            big, _ = prefill_logits(method, 4, 16)
            assert big.active_tokens > small.active_tokens > 64
            again, logits_again = prefill_logits(method, 2, 4)
            assert again.evidence == small.evidence
            assert torch.equal(logits_again, logits), method
            assert again.token_ids == small.token_ids
    finally:
        hook.remove()
