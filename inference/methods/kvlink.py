"""``kvlink``: the top-``kc`` chunks' stored KV placed with a gap after each, trained link tokens
and the query prefilled in one forward over it (``inference.context.link``), then greedy decoding.

The link tokens come from an adapter folder ``coinrag train kvlink`` writes
(``kvlink.json`` + ``link_embeddings.safetensors``), given as the engine's model
(``--model DIR``): the engine loads the transformer ``kvlink.json`` names, whose fingerprint
keys the store's KV; answers carry the adapter's ``kvlink_fp``. Active tokens count the links
(``n_link`` per chunk): they take KV memory too.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from coinrag.inference.context.link import (
    LinkAdapterInfo,
    LinkEmbeddings,
    link_forward,
    load_link_adapter,
)
from coinrag.inference.methods.assets import Index, StoredChunkKv, StoredKv, kv_read_errors
from coinrag.inference.methods.base import Asset, MissingAssets, Turn
from coinrag.inference.methods.turborag import TurboRag
from coinrag.inference.model.generate import Generation, Prefilled, decode_greedy

if TYPE_CHECKING:
    from coinrag.inference.methods.engine import RagEngine

TRAIN_COMMAND = "coinrag train kvlink --store STORE --data qa.jsonl --out DIR"


class LinkAdapter(Asset[tuple[LinkEmbeddings, LinkAdapterInfo]]):
    """The engine's trained link tokens (``RagEngine.link_adapter``), for its model."""

    @classmethod
    def load(cls, engine: RagEngine) -> tuple[LinkEmbeddings, LinkAdapterInfo]:
        if engine.link_adapter is None:
            raise MissingAssets(
                f"kvlink needs trained link tokens: run `{TRAIN_COMMAND}`, then pass --model DIR"
            )
        links, info = load_link_adapter(engine.link_adapter)
        model_fp = engine.model_at(engine.kv_dtype).model_fp
        if info.model_fp != model_fp:
            raise MissingAssets(
                f"the link adapter {engine.link_adapter} was trained for model {info.model_fp}, "
                f"not {model_fp}: train it again with `{TRAIN_COMMAND}`"
            )
        return links, info


class KvLink(TurboRag, name="kvlink"):
    """Stored chunk KV, ``n_link`` trained link tokens after each chunk, then the query."""

    needs = (Index, StoredChunkKv, LinkAdapter)

    def generate(self, turn: Turn) -> tuple[Generation, int]:
        engine, evidence = self.engine, turn.found.evidence
        links, _ = engine.asset(LinkAdapter)
        if turn.kc > links.max_docs:  # link rows are per document slot: never wrap around
            raise ValueError(
                f"the link adapter covers at most {links.max_docs} documents; got kc {turn.kc}"
            )
        query_ids = engine.prompt.query_ids(turn.question)
        context = engine.asset(StoredKv)
        model = self.loaded.model
        device, dtype = context.device, next(model.parameters()).dtype
        t0 = time.perf_counter()
        with kv_read_errors(context, evidence):
            prefix_kv, slices = context.load(evidence)
        turn.timings["kv_load"] += (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        prefix_kv = prefix_kv.to(device, dtype=dtype)
        slices = [replace(s, kv=s.kv.to(device, dtype=dtype)) for s in slices]
        turn.timings["assembly"] += (time.perf_counter() - t1) * 1000
        t2 = time.perf_counter()
        with torch.inference_mode():
            out = link_forward(model, links, prefix_kv, slices, query_ids, context.spec)
        gen = decode_greedy(
            model,
            self.loaded.tokenizer,
            Prefilled(
                out.cache,
                out.logits[-1],
                out.next_position,
                prefill_ms=(time.perf_counter() - t2) * 1000,
            ),
            max_new_tokens=engine.max_new_tokens,
            on_token=turn.on_token,
        )
        return gen, sum(s.tokens for s in slices) + links.n_link * len(slices)

    def fingerprint(self) -> str:
        """The link adapter's ``kvlink_fp`` (the model and the trained links)."""
        return self.engine.asset(LinkAdapter)[1].kvlink_fp
