"""KVLink on the store's assets: stored chunk KV, trained link tokens, then the query.

KVLink (Yang et al. 2025, arXiv 2502.16002; code UCSB-NLP-Chang/KVLink) encodes documents
separately and restores their cross-attention with a few trained *link tokens* after each
document. Its layout (``src/data/titan_preprocessor.py``) over one global ``arange`` of
positions::

    prefix | doc_1 | links_1 | doc_2 | links_2 | ... | doc_k | links_k | query (| answer)

with ``n_link`` (5) link tokens per document slot, distinct per slot (slot ``d``'s link ``j`` is
row ``d * n_link + j`` of :class:`LinkEmbeddings`, as KVLink's ids
``special_token_start + reencode_num * d + j``). Its mask (``make_segment_mask``): causal; a
document row sees only its own document; every other row (prefix, links, query, answer) sees
all earlier tokens (:func:`segment_mask`).

Here (:func:`link_forward`) the documents are the retrieved chunks' **stored** KV, as the KV
stage computed it: each chunk encoded right after the prompt prefix (so a document row also
saw the prefix, at distance ``|p| + t`` from it: the relocation approximation TurboRAG and
CoinRAG make too), re-rotated from positions ``|p|..`` to its global position, leaving gaps
for the links. The link tokens and the query (and, in training, the answer) are then prefilled
in **one** forward, appended after the context in the cache with their global position ids and
the mask "key position <= query position" (:func:`inference.model.masks.key_position_mask`); the
cache is then put back in position order (cache index = position), so decoding continues at
position ``T`` as after one forward. Sliding-window layers (Mistral, Gemma 2/3) get the same
mask limited to their window (``inference.model.masks.layer_masks``: one mask per layer type) over a
cache that keeps every position. The forward is differentiable in the link embeddings:
training (``training/kvlink.py``) runs the same function with ``tail = query + answer``.

Oracles (``tests/inference/test_kvlink_oracle.py``): with documents encoded *alone* (positions
``0..n``)
the result equals **one** forward over the whole layout with KVLink's own mask; with one stored
document it equals one forward with the mask where documents also see the prefix.

The link embeddings are a separate small set of input embeddings fed through
``inputs_embeds``, not new rows of the vocabulary: new special tokens would change the
tokenizer's fingerprint (and so every chunk of the store), and a tied LM head would let greedy
decoding emit them. With the base model frozen, the store's chunk KV stays valid. The trained
set is a folder (:func:`save_link_adapter`): ``link_embeddings.safetensors`` and ``kvlink.json``
(the transformer it goes with, ``kvlink_fp``, the training lineage).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from coinrag.inference.context.assemble import KvSlice, place_slices
from coinrag.inference.model.encode import causal_lm, to_dynamic_cache
from coinrag.inference.model.masks import check_attention, layer_masks
from coinrag.inference.rope import ModelRope, reset_rotary
from coinrag.schemas.keys import fingerprint, sha256_hex

DEFAULT_N_LINK = 5  # KVLink's reencode_num
DEFAULT_MAX_DOCS = 16  # document slots with their own link rows (bounds kc)
LINKS_FILE = "link_embeddings.safetensors"
ADAPTER_FILE = "kvlink.json"

PREFIX_SEGMENT, GLOBAL_SEGMENT = 0, -1  # document d has segment d + 1


class LinkEmbeddings(torch.nn.Module):
    """The link tokens: ``weight`` ``(max_docs * n_link, hidden)``; row ``d * n_link + j`` is
    link ``j`` after document slot ``d``."""

    def __init__(self, max_docs: int, n_link: int, hidden: int, dtype=torch.float32) -> None:
        super().__init__()
        if max_docs < 1 or n_link < 1:
            raise ValueError(f"max_docs and n_link must be >= 1; got {max_docs}, {n_link}")
        self.max_docs, self.n_link = max_docs, n_link
        self.weight = torch.nn.Parameter(torch.zeros(max_docs * n_link, hidden, dtype=dtype))

    @classmethod
    def for_model(
        cls, model: Any, max_docs: int = DEFAULT_MAX_DOCS, n_link: int = DEFAULT_N_LINK
    ) -> LinkEmbeddings:
        """Every row initialised to the mean of ``model``'s input embeddings (float32)."""
        table = causal_lm(model).get_input_embeddings().weight.detach()
        links = cls(max_docs, n_link, int(table.shape[1]))
        with torch.no_grad():
            links.weight.copy_(table.float().mean(dim=0).expand_as(links.weight))
        return links

    def rows(self, docs: int) -> torch.Tensor:
        """``(docs * n_link, hidden)``: the links of slots ``0..docs-1``, in layout order."""
        if docs > self.max_docs:
            raise ValueError(
                f"the link adapter covers at most {self.max_docs} documents; got {docs} (--kc)"
            )
        return self.weight[: docs * self.n_link]

    def sha256(self) -> str:
        """Hash of the weights (float32 little-endian bytes) and their shape."""
        w = self.weight.detach().float().cpu().contiguous()
        return sha256_hex("links", str(tuple(w.shape)), w.numpy().tobytes())


# ---------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class LinkLayout:
    """Global positions of ``prefix | doc_1 | links_1 | ... | tail`` (one ``arange``).

    ``segments``: ``(T,)`` segment id per position (prefix 0, document ``d`` ``d + 1``, links
    and tail -1); ``doc_starts``: first position of each document; ``new_positions``: the
    positions prefilled online, links of every slot then the tail, ``(k * n_link + n_tail,)``.

    E.g. ``P = 2``, documents of 3 and 2 tokens, 1 link, 2 tail tokens: doc starts ``[2, 6]``,
    new positions ``[5, 8, 9, 10]``, ``T = 11``.
    """

    segments: torch.Tensor
    doc_starts: list[int]
    new_positions: torch.Tensor

    @classmethod
    def build(cls, n_prefix: int, doc_lens: Sequence[int], n_link: int, n_tail: int) -> LinkLayout:
        segments = [PREFIX_SEGMENT] * n_prefix
        starts, links = [], []
        for d, n in enumerate(doc_lens):
            starts.append(len(segments))
            segments += [d + 1] * n
            links += range(len(segments), len(segments) + n_link)
            segments += [GLOBAL_SEGMENT] * n_link
        tail = list(range(len(segments), len(segments) + n_tail))
        segments += [GLOBAL_SEGMENT] * n_tail
        return cls(torch.tensor(segments), starts, torch.tensor(links + tail, dtype=torch.long))

    @property
    def total(self) -> int:
        return int(self.segments.numel())


def segment_mask(
    segments: torch.Tensor, dtype: torch.dtype, *, docs_see_prefix: bool = False
) -> torch.Tensor:
    """KVLink's ``(1, 1, T, T)`` additive mask over a :class:`LinkLayout`'s segments: causal; a
    document row sees only its own document (``docs_see_prefix``: and the prompt prefix, as
    the store encodes chunks); every other row sees all earlier tokens. For a one-forward
    evaluation (KVLink's own) and the oracle tests."""
    t = segments.numel()
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    doc_row = (segments > 0)[:, None]
    same = segments[:, None] == segments[None, :]
    allowed = ~doc_row | same
    if docs_see_prefix:
        allowed |= (segments == PREFIX_SEGMENT)[None, :]
    mask = torch.zeros(t, t, dtype=dtype).masked_fill_(~(causal & allowed), torch.finfo(dtype).min)
    return mask[None, None]


# ---------------------------------------------------------------------------- the forward


@dataclass
class LinkForward:
    """The result of :func:`link_forward`: ``logits`` ``(kept, vocab)`` float32 of the last
    ``kept`` new tokens; ``cache`` (context, links, tail), decoding continues at
    ``next_position``; ``layout``."""

    logits: torch.Tensor
    cache: Any
    next_position: int
    layout: LinkLayout


def link_forward(
    model: Any,
    links: LinkEmbeddings,
    prefix_kv: torch.Tensor,
    documents: Sequence[KvSlice],
    tail_ids: Sequence[int],
    spec: ModelRope,
    *,
    logits_to_keep: int = 1,
) -> LinkForward:
    """Place the documents' KV with gaps, prefill every slot's links and ``tail_ids`` in one
    forward (in the caller's grad mode; see the module doc).

    Args:
        prefix_kv: ``C_p`` ``(layers, 2, H, P, D)``.
        documents: each document's KV and where it was encoded (stored chunks: ``old_start =
            P``); ``k <= links.max_docs``.
        tail_ids: the query (and, in training, the answer) tokens.
        logits_to_keep: logits of the last this many new tokens (0: all of them).
    """
    lm = causal_lm(model)
    check_attention(lm.config)
    n_prefix = prefix_kv.shape[-2]
    layout = LinkLayout.build(n_prefix, [d.tokens for d in documents], links.n_link, len(tail_ids))
    device = prefix_kv.device
    context = place_slices(prefix_kv, documents, layout.doc_starts, spec, new_seq_len=layout.total)
    key_positions = torch.cat(
        [torch.arange(n_prefix)]
        + [torch.arange(s, s + d.tokens) for d, s in zip(documents, layout.doc_starts, strict=True)]
        + [layout.new_positions]
    ).to(device)
    embed = lm.get_input_embeddings()
    tail = embed(torch.tensor([list(tail_ids)], device=device))[0]
    x = torch.cat([links.rows(len(documents)).to(device, tail.dtype), tail])[None]
    positions = layout.new_positions.to(device)
    reset_rotary(model)
    out = lm(
        inputs_embeds=x,
        position_ids=positions[None],
        past_key_values=to_dynamic_cache(context, None),  # every position of every layer
        attention_mask=layer_masks(lm.config, key_positions, positions, x.dtype),
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    cache = out.past_key_values
    order = torch.argsort(key_positions)  # links and tail back between the documents
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, order]
        layer.values = layer.values[:, :, order]
    return LinkForward(out.logits[0].float(), cache, layout.total, layout)


# ---------------------------------------------------------------------------- the adapter


@dataclass
class LinkAdapterInfo:
    """``kvlink.json``: what the link embeddings go with and where they came from.

    ``model``: the transformer they were trained with (a reference ``load_model`` takes: the
    base model when it stayed frozen); ``model_fp``: its fingerprint (it keys the store's KV);
    ``kvlink_fp``: :func:`kvlink_fingerprint`, the identity of (model, links) that answers
    carry; ``lineage``: the training run (data hash, settings, steps, losses, run id).
    """

    n_link: int
    max_docs: int
    model: str
    model_fp: str
    links_sha256: str
    kvlink_fp: str
    lineage: dict[str, Any] = field(default_factory=dict)


def kvlink_fingerprint(model_fp: str, links_sha256: str, n_link: int, max_docs: int) -> str:
    """``kvlink-`` + 16 hex over the transformer and the link weights."""
    return fingerprint(
        "kvlink",
        {"model_fp": model_fp, "links": links_sha256, "n_link": n_link, "max_docs": max_docs},
    )


def is_link_adapter(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_FILE).is_file()


def save_link_adapter(
    out_dir: str | os.PathLike[str],
    links: LinkEmbeddings,
    model_ref: str,
    model_fp: str,
    lineage: dict[str, Any] | None = None,
) -> LinkAdapterInfo:
    """Write ``LINKS_FILE`` and ``ADAPTER_FILE`` into ``out_dir`` (the JSON last: a folder
    with a readable ``kvlink.json`` is complete)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight = links.weight.detach().float().cpu().contiguous()
    save_file({"weight": weight}, str(out / LINKS_FILE))
    digest = links.sha256()
    info = LinkAdapterInfo(
        n_link=links.n_link,
        max_docs=links.max_docs,
        model=model_ref,
        model_fp=model_fp,
        links_sha256=digest,
        kvlink_fp=kvlink_fingerprint(model_fp, digest, links.n_link, links.max_docs),
        lineage=dict(lineage or {}),
    )
    tmp = out / (ADAPTER_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(info), indent=2, default=str), encoding="utf-8")
    tmp.replace(out / ADAPTER_FILE)
    return info


def read_link_adapter_info(path: str | os.PathLike[str]) -> LinkAdapterInfo:
    """The ``kvlink.json`` of an adapter folder."""
    data = json.loads((Path(path) / ADAPTER_FILE).read_text(encoding="utf-8"))
    return LinkAdapterInfo(**data)


def load_link_adapter(path: str | os.PathLike[str]) -> tuple[LinkEmbeddings, LinkAdapterInfo]:
    """The link embeddings of an adapter folder and its ``kvlink.json``; ValueError when the
    weights are not the ones the JSON names."""
    from safetensors.torch import load_file

    folder = Path(path)
    info = read_link_adapter_info(folder)
    weight = load_file(str(folder / LINKS_FILE))["weight"]
    links = LinkEmbeddings(info.max_docs, info.n_link, int(weight.shape[1]))
    with torch.no_grad():
        links.weight.copy_(weight)
    links.requires_grad_(False)
    if links.sha256() != info.links_sha256:
        raise ValueError(f"{folder / LINKS_FILE} does not match {ADAPTER_FILE} (links_sha256)")
    return links, info
