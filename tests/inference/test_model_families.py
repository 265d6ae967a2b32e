"""The coverage matrix of model families (docs/model-families.md), each family a tiny random
config (``tests/model_families.py``), in SDPA and eager attention, against transformers itself:

1. the stored KV (the KV stage's encoding: ``compute_prefix_kv`` then a right-padded batch of
   chunks after it) equals the model's own forward over ``prefix + chunk`` (every position of
   every layer: sliding layers with transformers' sliding cache recording the past), and the
   positions transformers' own sliding cache keeps;
2. turborag ``--kc 1`` equals standard ``--kc 1``: the serving path (stored KV assembled,
   handed over with ``to_dynamic_cache(ctx, config)``, query prefilled, greedy decoding) gives
   the greedy tokens of one forward over ``prefix + chunk + query`` and its first-token logits
   within LOGIT_ATOL_FP32;
3. coinrag's assembled context (nugget slices of two chunks, reordered and moved) equals an
   assembly made with transformers' own per-layer rotary embedding (each layer's cos/sin from
   the model's rotary module for that layer's type, applied with the model's own
   ``apply_rotary_pos_emb``): rel. error <= FP32_RTOL;
4. the methods that train run one step (nugget fine-tuning's live context and answer loss,
   a cartridge's distillation loss, KVLink's link tokens): finite gradients that reach what
   trains, and the loss moves after one optimizer step. Cartridges refuse length-dependent
   RoPE (Phi-3's longrope) by design (``inference.context.assemble.check_rope``).

Tolerances: FP32_RTOL = 1e-5 of the largest magnitude (float32 rounding of other matmul shapes
and of the rotation; observed <= 1e-6), LOGIT_ATOL_FP32 = 2e-4 (as
tests/inference/test_assembly_oracle.py;
observed <= 1e-6 on these models).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch
from model_families import WINDOW, family_cases, family_model
from store_fixtures import random_ids, synthetic_chunk
from transformers import DynamicCache

from coinrag.inference.context.assemble import KvSlice, assemble_cartridges, assemble_context
from coinrag.inference.context.builders import encode_after_prefix
from coinrag.inference.context.link import LinkEmbeddings, LinkLayout, link_forward, segment_mask
from coinrag.inference.model.encode import (
    cache_to_kv,
    compute_chunk_kv,
    compute_prefix_kv,
    decoder,
    to_dynamic_cache,
)
from coinrag.inference.model.generate import prefill_and_decode
from coinrag.inference.model.layers import AttentionLayers
from coinrag.inference.rope import LayerRopes, UnsupportedRope, model_rope
from coinrag.training.cartridges import Example, example_loss, init_cartridge
from coinrag.training.objective import answer_loss_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP32_RTOL = 1e-5
LOGIT_ATOL_FP32 = 2e-4
CASES = family_cases()
IDS = [f"{f}-{a}" for f, a in CASES]

PREFIX = random_ids(6, 1)
CHUNK_A, CHUNK_B = random_ids(24, 2), random_ids(13, 3)  # A: 3 windows long
QUERY, ANSWER = random_ids(5, 4), random_ids(4, 5)


@functools.cache
def _model(family: str, attn: str):
    return family_model(family, attn)


def _row(i: int, ids: list[int]):
    return dataclasses.replace(synthetic_chunk(i, len(ids)), token_ids=ids)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@torch.inference_mode()
def _own_forward(model, ids: list[int]):
    """(every layer's KV ``(layers, 2, H, T, D)``, transformers' default cache): one forward
    over ``ids``; sliding layers record their past instead of keeping only the window."""
    recording = DynamicCache(config=model.config)
    for layer in recording.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    decoder(model)(input_ids=torch.tensor([ids]), past_key_values=recording, use_cache=True)
    default = decoder(model)(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    return cache_to_kv(recording)[0], default


def _stored(model, chunks: list[list[int]]):
    """``C_p`` and each chunk's KV as the KV stage computes them (one padded batch)."""
    prefix_kv = compute_prefix_kv(model, PREFIX)
    rows = [_row(i, c) for i, c in enumerate(chunks)]
    return prefix_kv, compute_chunk_kv(model, prefix_kv, rows, pad_id=0)


# ---------------------------------------------------------------------------- 1. stored KV


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_stored_kv_is_the_models_own_forward(family: str, attn: str) -> None:
    model = _model(family, attn)
    prefix_kv, (kv_a, kv_b) = _stored(model, [CHUNK_A, CHUNK_B])
    p = len(PREFIX)
    for chunk, kv in ((CHUNK_A, kv_a), (CHUNK_B, kv_b)):
        own, default = _own_forward(model, PREFIX + chunk)
        assert kv.shape == own[..., p:, :].shape
        assert _rel(kv, own[..., p:, :]) <= FP32_RTOL
        assert _rel(prefix_kv, own[..., :p, :]) <= FP32_RTOL
        # transformers' own sliding cache keeps the last W - 1 positions: those are ours
        ours = torch.cat([prefix_kv, kv], dim=-2)
        for i, layer in enumerate(default.layers):
            kept = layer.keys.shape[-2]
            assert kept == (WINDOW - 1 if layer.is_sliding else p + len(chunk))
            assert _rel(ours[i, 0, :, -kept:], layer.keys[0]) <= FP32_RTOL


# ---------------------------------------------------------------------------- 2. kc 1


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_turborag_kc1_equals_standard_kc1(family: str, attn: str, smollm2_tokenizer) -> None:
    model, tok = _model(family, attn), smollm2_tokenizer
    prefix_kv, (kv,) = _stored(model, [CHUNK_A])
    p, n = len(PREFIX), len(CHUNK_A)
    rope = model_rope(model.config)
    ctx = assemble_context(prefix_kv, [KvSlice(kv, p, p + n)], rope, new_seq_len=p + n + 5)
    turbo = prefill_and_decode(
        model,
        tok,
        to_dynamic_cache(ctx, model.config),
        p + n,
        QUERY,
        max_new_tokens=8,
        keep_first_logits=True,
    )
    standard = prefill_and_decode(
        model, tok, None, 0, PREFIX + CHUNK_A + QUERY, max_new_tokens=8, keep_first_logits=True
    )
    assert turbo.token_ids == standard.token_ids
    assert float((turbo.first_logits - standard.first_logits).abs().max()) <= LOGIT_ATOL_FP32


# ---------------------------------------------------------------------------- 3. assembly


def _hf_move(model, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor, layer: int):
    """Layer ``layer``'s keys ``(H, T, D)`` moved from ``old`` to ``new`` positions by
    transformers: the model's rotary module (for the layer's type) and its modeling file's
    ``apply_rotary_pos_emb``, un-rotating with ``-sin``; ``attention_scaling`` (inside both
    cos and sin) divided out of the rotated dims twice. Float64 after the model's float32
    cos/sin."""
    rotary = decoder(model).rotary_emb
    extra = ()
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        extra = (model.config.layer_types[layer],)
    x = torch.zeros(1, dtype=torch.float64)
    cos_old, sin_old = rotary(x, old[None], *extra)
    cos_new, sin_new = rotary(x, new[None], *extra)
    scale = float(cos_old[0, 0, 0] ** 2 + sin_old[0, 0, 0] ** 2) ** 0.5
    apply = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    k = keys.double()[None]
    _, back = apply(k, k, cos_old, -sin_old)
    _, moved = apply(back, back, cos_new, sin_new)
    rotary_dim = cos_new.shape[-1]  # partial rotary: the other dims pass through unscaled
    moved[..., :rotary_dim] /= scale**2
    return moved[0]


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_assembled_context_equals_transformers_per_layer_rotary(family: str, attn: str) -> None:
    model = _model(family, attn)
    prefix_kv, (kv_a, kv_b) = _stored(model, [CHUNK_A, CHUNK_B])
    p = len(PREFIX)
    cuts = [(kv_b, 3, 12, len(CHUNK_B)), (kv_a, 5, 20, len(CHUNK_A))]  # B's slice first
    slices = [KvSlice(kv[..., s:e, :], p + s, p + n) for kv, s, e, n in cuts]
    rope = model_rope(model.config)
    total = p + sum(e - s for _, s, e, _ in cuts)
    ctx = assemble_context(prefix_kv, slices, rope, new_seq_len=total + len(QUERY))
    assert torch.equal(ctx[..., :p, :], prefix_kv)
    start = p
    for kv, s, e, _ in cuts:
        old, new = torch.arange(p + s, p + e), torch.arange(start, start + e - s)
        for layer in range(kv.shape[0]):
            want = _hf_move(model, kv[layer, 0, :, s:e], old, new, layer)
            got = ctx[layer, 0, :, start : start + e - s]
            assert _rel(got, want) <= FP32_RTOL, (layer, _rel(got, want))
        assert torch.equal(ctx[:, 1, :, start : start + e - s], kv[:, 1, :, s:e])
        start += e - s
    if family == "gemma3":  # dual RoPE: the local and the global layers rotate differently
        assert isinstance(rope, LayerRopes)
        assert not torch.equal(rope.specs[0].inv_freq, rope.specs[1].inv_freq)


# ---------------------------------------------------------------------------- 4. training


def _finite_grads(params) -> list[torch.Tensor]:
    grads = [q.grad for q in params if q.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    return grads


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_finetune_step_runs(family: str, attn: str) -> None:
    """Nugget fine-tuning, ``live`` mode: prefix and chunks encoded with gradients (the KV
    stage's encoding), nugget slices assembled, answer loss after the query."""
    model = family_model(family, attn)
    model.train()
    rope = model_rope(model.config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        prefix_kv = compute_prefix_kv(model, PREFIX, differentiable=True)
        kv_a, kv_b = encode_after_prefix(model, prefix_kv, [CHUNK_A, CHUNK_B])
        p = len(PREFIX)
        slices = [KvSlice(kv_a[..., 4:18, :], p + 4, p + 24), KvSlice(kv_b, p, p + 13)]
        total = p + 14 + 13
        ctx = assemble_context(prefix_kv, slices, rope, new_seq_len=total + 9)
        loss = answer_loss_sum(model, ctx, total, QUERY, ANSWER)
        opt.zero_grad()
        loss.backward()
        _finite_grads(model.parameters())
        opt.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[1] != losses[0]


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_cartridge_step_runs(family: str, attn: str) -> None:
    model = _model(family, attn)
    rope = model_rope(model.config)
    prompt = SimpleNamespace(prefix_ids=PREFIX, n_prefix=len(PREFIX), tokenizer=None)
    if rope.seq_len_dependent:  # longrope: cartridges have canonical positions, no length
        with pytest.raises(UnsupportedRope, match="depends on the sequence length"):
            init_cartridge(model, prompt, rope, CHUNK_A, 10)
        return
    z = torch.nn.Parameter(init_cartridge(model, prompt, rope, CHUNK_A, 10))
    prefix = compute_prefix_kv(model, PREFIX).clone()
    g = torch.Generator().manual_seed(0)
    example = Example(
        "e",
        "c",
        tuple(QUERY),
        tuple(ANSWER),
        torch.randint(3, 500, (len(ANSWER), 3), generator=g),
        torch.randn(len(ANSWER), 4, generator=g).log_softmax(-1)[:, :3],
    )
    model.requires_grad_(False)
    opt = torch.optim.SGD([z], lr=1.0)
    try:
        losses = []
        for _ in range(2):
            loss = example_loss(model, prefix, rope, [z], example)
            opt.zero_grad()
            loss.backward()
            (grad,) = _finite_grads([z])
            assert grad.abs().sum() > 0
            opt.step()
            losses.append(loss.item())
    finally:
        model.requires_grad_(True)
    assert losses[1] != losses[0]
    with torch.no_grad():  # the cartridge sits after the prefix, as served
        assert assemble_cartridges(prefix, [z], rope).shape[-2] == len(PREFIX) + 10


@pytest.mark.parametrize(("family", "attn"), CASES, ids=IDS)
def test_kvlink_step_runs(family: str, attn: str) -> None:
    model = _model(family, attn)
    rope = model_rope(model.config)
    prefix_kv, (kv_a, kv_b) = _stored(model, [CHUNK_A, CHUNK_B])
    p = len(PREFIX)
    docs = [KvSlice(kv_a, p, p + 24), KvSlice(kv_b, p, p + 13)]
    links = LinkEmbeddings.for_model(model, max_docs=3, n_link=2)
    model.requires_grad_(False)
    opt = torch.optim.SGD(links.parameters(), lr=1.0)
    try:
        losses = []
        for _ in range(2):
            out = link_forward(
                model, links, prefix_kv, docs, QUERY + ANSWER, rope, logits_to_keep=5
            )
            loss = torch.nn.functional.cross_entropy(out.logits[:-1], torch.tensor(ANSWER))
            opt.zero_grad()
            loss.backward()
            (grad,) = _finite_grads(links.parameters())
            per_slot = grad.view(3, 2, -1).norm(dim=(1, 2))
            # the last document's links reach the answer (in an all-sliding model the first
            # one's may lie beyond the layers' reach); the unused slot gets nothing
            assert per_slot[1] > 0 and per_slot[2] == 0
            opt.step()
            losses.append(loss.item())
    finally:
        model.requires_grad_(True)
    assert losses[1] != losses[0]


# ---------------------------------------------------------------------------- sliding windows


SLIDING = [(f, a) for f, a in CASES if f in ("qwen2", "mistral", "gemma2", "gemma3")]


@pytest.mark.parametrize(("family", "attn"), SLIDING, ids=[f"{f}-{a}" for f, a in SLIDING])
def test_kvlink_on_sliding_layers_equals_one_forward(family: str, attn: str) -> None:
    """One stored document: link_forward (per-layer-type masks over a full cache) equals one
    forward over the layout with the store's mask (documents see the prefix), each sliding
    layer's limited to its window; the cache is in position order and decoding continues as
    from that forward."""
    model = _model(family, attn)
    torch.manual_seed(1)
    links = LinkEmbeddings(2, 3, 64)
    with torch.no_grad():
        links.weight.normal_(std=0.5)
    prefix_kv, (kv,) = _stored(model, [CHUNK_A])
    p = len(PREFIX)
    with torch.inference_mode():
        got = link_forward(
            model,
            links,
            prefix_kv,
            [KvSlice(kv, p, p + 24)],
            QUERY,
            model_rope(model.config),
            logits_to_keep=0,
        )
    emb = model.get_input_embeddings()
    layout = LinkLayout.build(p, [24], 3, len(QUERY))
    x = torch.cat(
        [emb(torch.tensor([PREFIX + CHUNK_A]))[0], links.weight[:3], emb(torch.tensor([QUERY]))[0]]
    )[None].detach()
    seg = segment_mask(layout.segments, x.dtype, docs_see_prefix=True)
    pos = torch.arange(layout.total)

    def windowed(window):
        if window is None:
            return seg
        return seg.masked_fill(~(pos[None, :] > pos[:, None] - window), torch.finfo(x.dtype).min)

    layers = AttentionLayers.from_config(model.config)
    mask = (
        windowed(layers.windows[0])
        if layers.uniform
        else {t: windowed(layers.window_of(t)) for t in set(layers.types)}
    )
    with torch.inference_mode():
        ref = model(
            inputs_embeds=x,
            position_ids=pos[None],
            attention_mask=mask,
            past_key_values=DynamicCache(),
            use_cache=True,
        )
    new = layout.new_positions
    assert float((got.logits - ref.logits[0, new]).abs().max()) <= LOGIT_ATOL_FP32
    want = cache_to_kv(ref.past_key_values)[0]
    assert _rel(cache_to_kv(got.cache)[0], want) <= FP32_RTOL
    from kv_oracle import greedy_after

    t = layout.total
    assert greedy_after(model, got.cache, got.logits[-1], t, 6) == greedy_after(
        model, ref.past_key_values, ref.logits[0, -1], t, 6
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_chunk_longer_than_the_window(attn: str) -> None:
    """What a stored chunk is for a sliding layer (docs/model-families.md):
    token ``t``'s K/V in layer ``l``
    are those of one forward over ``prefix + chunk`` and depend only on positions
    ``>= t - l (W - 1)`` of it (Mistral: every layer slides, window 8); and once assembled,
    a sliding layer of the query sees only the last ``W - 1`` context positions, so what lies
    before them in every layer changes nothing the query computes."""
    model = _model("mistral", attn)
    changed = [(t + 7) % 500 for t in CHUNK_A[:5]] + CHUNK_A[5:]
    _, (kv,) = _stored(model, [CHUNK_A])
    _, (kv2,) = _stored(model, [changed])
    reach = [4 + layer * (WINDOW - 1) for layer in range(kv.shape[0])]  # last changed + l(W-1)
    for layer, last in enumerate(reach):
        assert torch.equal(kv[layer, :, :, last + 1 :], kv2[layer, :, :, last + 1 :])
        assert not torch.equal(kv[layer, :, :, last], kv2[layer, :, :, last])
    # kc 2, the long chunk first: in an all-sliding model the query never reads it
    prefix_kv, (kv_a, kv_b) = _stored(model, [CHUNK_A, CHUNK_B])
    p = len(PREFIX)
    rope = model_rope(model.config)
    ctx = assemble_context(prefix_kv, [KvSlice(kv_a, p, p + 24), KvSlice(kv_b, p, p + 13)], rope)
    blanked = ctx.clone()
    t = ctx.shape[-2]
    blanked[..., : t - (WINDOW - 1), :] = 0  # everything but the last W - 1 positions
    answers = [
        prefill_and_decode(
            model,
            SimpleNamespace(eos_token_id=None, decode=lambda ids, **_: ""),
            to_dynamic_cache(c, model.config),
            t,
            QUERY,
            max_new_tokens=6,
            keep_first_logits=True,
        )
        for c in (ctx, blanked)
    ]
    assert torch.equal(answers[0].first_logits, answers[1].first_logits)
    assert answers[0].token_ids == answers[1].token_ids


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_teacher_and_full_document_cartridge_on_sliding_layers(family: str, smollm2_tokenizer):
    """Self-study's teacher answers each question as one forward over prefix + document +
    question would (sliding models: one question at a time), and a cartridge holding the
    whole document at canonical positions gives the student the teacher's log-probs."""
    from coinrag.inference.model.encode import prefix_kv
    from coinrag.inference.model.prompt import RagPrompt
    from coinrag.schemas.settings import TeacherSettings
    from coinrag.tasks.teacher import teacher_answers
    from coinrag.training.cartridges import student_logprobs

    tok = smollm2_tokenizer
    model = family_model(family, tokenizer=tok)
    prompt = RagPrompt.for_tokenizer(tok)
    doc = random_ids(30, 7)
    questions = ["Who wrote it?", "Where is the river that runs through the valley?"]
    cfg = TeacherSettings(max_new_tokens=5, batch_size=2)
    outs = teacher_answers(model, tok, prompt, doc, questions, cfg)
    rope = model_rope(model.config)
    z = init_cartridge(model, prompt, rope, doc, p=len(doc))
    ctx = assemble_cartridges(prefix_kv(model, prompt), [z], rope)
    for q, out in zip(questions, outs, strict=True):
        ids = list(prompt.prefix_ids) + doc + prompt.query_ids(q)
        alone = prefill_and_decode(model, tok, None, 0, ids, max_new_tokens=5)
        assert [t for t in out.answer_ids if t != tok.eos_token_id] == alone.token_ids
        with torch.no_grad():
            logp = student_logprobs(model, ctx, prompt.query_ids(q), out.answer_ids)
        got = logp.gather(-1, out.topk_ids)
        assert float((got - out.topk_logprobs).abs().max()) <= LOGIT_ATOL_FP32


@pytest.mark.parametrize("family", [f for f, a in CASES if a == "eager"])
def test_quantized_frame_keys_at_position_zero(family: str) -> None:
    """A quantized store keeps keys rotated back to position 0 (``keys_to_position_zero``),
    each layer with its own RoPE; placed from there they equal the slices placed from where
    they were encoded."""
    from coinrag.inference.model.encode import keys_to_position_zero

    model = _model(family, "eager")
    prefix_kv, (kv_a, kv_b) = _stored(model, [CHUNK_A, CHUNK_B])
    p = len(PREFIX)
    rope = model_rope(model.config)
    zero_a = keys_to_position_zero(kv_a, rope, p)
    zero_b = keys_to_position_zero(kv_b, rope, p)
    moved = [KvSlice(kv_b[..., 2:9, :], p + 2, p + 13), KvSlice(kv_a, p, p + 24)]
    at_zero = [
        KvSlice(zero_b[..., 2:9, :], p + 2, p + 13, at_zero=True),
        KvSlice(zero_a, p, p + 24, at_zero=True),
    ]
    want = assemble_context(prefix_kv, moved, rope, new_seq_len=p + 31 + 5)
    got = assemble_context(prefix_kv, at_zero, rope, new_seq_len=p + 31 + 5)
    assert _rel(got, want) <= FP32_RTOL
