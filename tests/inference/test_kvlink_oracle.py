"""KVLink online inference (``inference/context/link.py``) against one transformers forward.

KVLink's own evaluation is one forward over ``prefix | doc_1 | links_1 | ... | query`` with its
4D segment mask. Ours places each document's KV (re-rotated, gaps left for the links) and
prefills the links and the query in one forward after it. The two must agree:

1. documents encoded *alone* (positions ``0..n-1``, KVLink's encoding) = one forward with
   KVLink's mask (documents see only themselves);
2. one document stored as the KV stage stores it (after the prompt prefix) = one forward with
   the mask where documents also see the prefix.

Tolerance: next-token logits of every new token max |Δ| <= 2e-4 (as
``tests/inference/test_assembly_oracle.py``; measured <= 2.1e-7), the whole cache within 1e-5 of its
largest value, and 8 greedy tokens equal.
"""

from __future__ import annotations

import pytest
import torch
from kv_oracle import chunk_kv, greedy_after, max_abs, prefix_kv
from store_fixtures import TINY_ARCHITECTURES, random_ids, tiny_model

from coinrag.inference.context.assemble import KvSlice
from coinrag.inference.context.link import (
    LinkEmbeddings,
    LinkLayout,
    kvlink_fingerprint,
    link_forward,
    load_link_adapter,
    save_link_adapter,
    segment_mask,
)
from coinrag.inference.model.encode import from_cache
from coinrag.inference.rope import RopeSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_ATOL_FP32 = 2e-4
N_LINK = 5


@pytest.fixture(
    scope="module",
    params=[(a, i) for a in TINY_ARCHITECTURES for i in ("sdpa", "eager")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def model(request):
    arch, attn = request.param
    return tiny_model(arch, attn_implementation=attn)


def _links(hidden: int = 64, max_docs: int = 4) -> LinkEmbeddings:
    torch.manual_seed(1)
    links = LinkEmbeddings(max_docs, N_LINK, hidden)
    with torch.no_grad():
        links.weight.normal_(std=0.5)
    return links


PREFIX, DOCS, QUERY = random_ids(7, 1), [random_ids(30, 2), random_ids(25, 3)], random_ids(6, 5)


@torch.inference_mode()
def _one_forward(model, links, docs, docs_see_prefix: bool):
    """KVLink's evaluation: one forward over the whole layout with the segment mask."""
    emb = model.get_input_embeddings()
    parts = [emb(torch.tensor([PREFIX]))[0]]
    for d, doc in enumerate(docs):
        parts += [emb(torch.tensor([doc]))[0], links.weight[d * N_LINK : (d + 1) * N_LINK]]
    parts.append(emb(torch.tensor([QUERY]))[0])
    x = torch.cat(parts)[None]
    layout = LinkLayout.build(len(PREFIX), [len(d) for d in docs], N_LINK, len(QUERY))
    mask = segment_mask(layout.segments, x.dtype, docs_see_prefix=docs_see_prefix)
    out = model(
        inputs_embeds=x,
        position_ids=torch.arange(x.shape[1])[None],
        attention_mask=mask,
        use_cache=True,
    )
    return out, layout


@torch.inference_mode()
def _alone(model, doc):
    return from_cache(model(input_ids=torch.tensor([doc]), use_cache=True).past_key_values)


def _compare(model, links, documents, docs) -> None:
    ref, layout = _one_forward(model, links, docs, docs_see_prefix=documents is not None)
    spec = RopeSpec.from_config(model.config)
    if documents is None:  # KVLink's encoding: each document alone at 0..n-1
        documents = [KvSlice(_alone(model, d), 0, len(d)) for d in docs]
    with torch.inference_mode():
        got = link_forward(
            model, links, prefix_kv(model, PREFIX), documents, QUERY, spec, logits_to_keep=0
        )
    new = layout.new_positions
    assert max_abs(got.logits, ref.logits[0, new]) <= LOGIT_ATOL_FP32
    # the cache link_forward leaves is in position order, as the one forward's
    ours = from_cache(got.cache)
    want = from_cache(ref.past_key_values)
    assert max_abs(ours, want) <= 1e-5 * float(want.abs().max())
    t = layout.total
    assert got.next_position == t
    assert greedy_after(model, got.cache, got.logits[-1], t, 8) == greedy_after(
        model, ref.past_key_values, ref.logits[0, -1], t, 8
    )


def test_documents_encoded_alone_equal_one_forward_with_kvlinks_mask(model) -> None:
    _compare(model, _links(), None, DOCS)


def test_one_stored_document_equals_one_forward_with_the_store_mask(model) -> None:
    stored = [KvSlice(chunk_kv(model, PREFIX, DOCS[0]), len(PREFIX), len(PREFIX) + len(DOCS[0]))]
    _compare(model, _links(), stored, DOCS[:1])


def test_layout_and_mask_by_hand() -> None:
    layout = LinkLayout.build(2, [3, 2], 1, 2)
    assert layout.segments.tolist() == [0, 0, 1, 1, 1, -1, 2, 2, -1, -1, -1]
    assert layout.doc_starts == [2, 6] and layout.new_positions.tolist() == [5, 8, 9, 10]
    seen = segment_mask(layout.segments, torch.float32)[0, 0] == 0
    assert seen[4].tolist() == [False, False, True, True, True] + [False] * 6  # doc 1: itself
    assert seen[7, :8].tolist() == [False] * 6 + [True, True]  # doc 2: only doc 2
    assert seen[8, :9].all() and not seen[8, 9:].any()  # a link: everything earlier
    with_prefix = segment_mask(layout.segments, torch.float32, docs_see_prefix=True)[0, 0] == 0
    assert with_prefix[7, :8].tolist() == [True, True] + [False] * 4 + [True, True]


def test_frozen_model_gradients_reach_only_the_used_link_slots() -> None:
    model = tiny_model("qwen2")
    model.requires_grad_(False)
    links = _links(max_docs=4)
    spec = RopeSpec.from_config(model.config)
    documents = [
        KvSlice(chunk_kv(model, PREFIX, d), len(PREFIX), len(PREFIX) + len(d)) for d in DOCS
    ]
    answer = random_ids(4, 9)
    out = link_forward(
        model,
        links,
        prefix_kv(model, PREFIX).clone(),
        [KvSlice(d.kv.clone(), d.old_start, d.old_seq_len) for d in documents],
        QUERY + answer,
        spec,
        logits_to_keep=len(answer) + 1,
    )
    loss = torch.nn.functional.cross_entropy(out.logits[:-1], torch.tensor(answer))
    loss.backward()
    grad = links.weight.grad.view(4, N_LINK, -1).norm(dim=(1, 2))
    assert (grad[:2] > 0).all() and (grad[2:] == 0).all(), grad
    assert all(p.grad is None for p in model.parameters())


def test_adapter_round_trip_and_fingerprint(tmp_path) -> None:
    model = tiny_model("llama3")
    links = _links()
    info = save_link_adapter(tmp_path / "a", links, "base-model", "m-1", {"steps": 2})
    loaded, read = load_link_adapter(tmp_path / "a")
    assert torch.equal(loaded.weight, links.weight) and read == info
    assert info.kvlink_fp == kvlink_fingerprint("m-1", links.sha256(), N_LINK, 4)
    spec = RopeSpec.from_config(model.config)
    doc = [KvSlice(chunk_kv(model, PREFIX, DOCS[0]), 7, 37)]
    with torch.inference_mode():
        a = link_forward(model, links, prefix_kv(model, PREFIX), doc, QUERY, spec).logits
        b = link_forward(model, loaded, prefix_kv(model, PREFIX), doc, QUERY, spec).logits
    assert torch.equal(a, b)
    with torch.no_grad():
        links.weight[0, 0] += 1.0
    assert save_link_adapter(tmp_path / "b", links, "base-model", "m-1").kvlink_fp != info.kvlink_fp
    (tmp_path / "b" / "link_embeddings.safetensors").write_bytes(
        (tmp_path / "a" / "link_embeddings.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match="does not match"):
        load_link_adapter(tmp_path / "b")


def test_more_documents_than_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 4 documents; got 5"):
        _links(max_docs=4).rows(5)
