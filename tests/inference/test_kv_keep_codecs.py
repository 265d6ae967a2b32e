"""``kv_keep = "nuggets"`` with the quantized codecs (``kv_codec = int8 | int4``): entries of
kept ranges, encoded by the codec, keys at position 0.

The KV stage rotates a chunk's keys back to position 0 (the quantized codecs' frame), then cuts
the kept ranges and concatenates them, and the codec quantizes that concatenation block by
block. So, against the same chunks stored whole with the same codec (same batches):

- values (quantized per token) are bit for bit the same;
- keys (quantized per channel over a block's tokens) are the same bits where the kept ranges
  and the blocks line up (a range starting at a block boundary, at a stored offset that is one
  too), and elsewhere each within the codec's stated bound of the float entry for the blocks
  the nuggets entry stores (``tests/inference/test_kv_codecs.py`` states the bounds);
- the re-rotation contract holds for slices of such an entry: the assembled keys are the
  dequantized entry's keys at the slice's stored offset, rotated from position 0, bit for bit.

Oracles: the float (``none``) store of whole chunks (held to transformers by
``tests/inference/test_assembly_oracle.py``), on SmolLM2 and tiny random Qwen2, Llama (also dynamic
NTK)
and Qwen3; end to end, ``coinrag build --kv-keep nuggets --kv-codec int4`` against
``--kv-keep chunks --kv-codec int4`` and a float store, through the CLI and ``RagEngine``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from store_fixtures import sample_docs, save_tiny_llama, write_corpus
from test_kv_codecs import (
    HALF_ULP,
    MODELS,
    ROUNDING,
    _layer_errors,
    _tiny,
    codec_chunks,
    codec_step_bounds,
    step_bounds,
)
from typer.testing import CliRunner

from coinrag.flows.build import build_flow
from coinrag.flows.cli import app
from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.methods import RagEngine
from coinrag.inference.methods.assets import StoredNuggetKv
from coinrag.inference.model.encode import keys_to_position_zero
from coinrag.inference.model.loading import LoadedModel
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import RopeSpec, rerotate_keys
from coinrag.schemas.tables import NuggetRow
from coinrag.storage.gc import kv_fps
from coinrag.storage.kv import KeptRanges, KvStore, UnstoredKvSlice, codec_named, entry_key
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.kv import KvOptions, kv_stage

DOCS = Path("/usr/share/doc/python3.11/html/_sources/faq/general.rst.txt")
QUESTION = "Who directed 2001: A Space Odyssey?"
# Kept ranges per chunk (chunk tokens): chunk 1's start at block boundaries (16-token blocks)
# at stored offsets 0 and 16, so its blocks are the whole-chunk entry's blocks.
SPANS = {
    0: [(3, 9), (7, 12), (20, 31)],  # -> [3, 12), [20, 31): 20 stored tokens
    1: [(0, 16), (32, 48)],
    2: [(0, 7), (21, 30)],
}
# coinrag requests (chunk, start, end): each inside one kept range
REQUESTS = [(2, 21, 30), (1, 33, 47), (0, 3, 12), (1, 2, 14), (2, 0, 5), (0, 24, 28)]
ALIGNED = {1}  # chunks whose kept blocks are the whole entry's


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=[*MODELS, "smollm2"])
def model(request, smollm2_tokenizer) -> LoadedModel:
    if request.param == "smollm2":
        from coinrag.inference.model.loading import load_model

        return load_model(None, dtype="bfloat16")
    arch = request.param.split("-")[0]
    return _tiny(arch, smollm2_tokenizer, **MODELS[request.param])


@pytest.fixture(scope="module")
def stores(model, tmp_path_factory):
    """Three chunks stored by ``model``, one chunk per forward: ``{(keep, codec): KvStore}``
    for whole chunks in ``none`` and ``int4``, and nugget spans (``SPANS``) in ``int8``,
    ``int4``, ``int2`` and ``int2mix``; and the chunks."""
    tok = model.tokenizer
    chunks = codec_chunks(tok)
    kept = {chunks[i].chunk_id: KeptRanges.of_spans(s) for i, s in SPANS.items()}
    prompt = RagPrompt.for_tokenizer(tok)
    root = tmp_path_factory.mktemp("keep-codecs")
    out = {}
    for keep, codec in (
        ("chunks", "none"),
        ("chunks", "int4"),
        ("nuggets", "int8"),
        ("nuggets", "int4"),
        ("nuggets", "int2"),
        ("nuggets", "int2mix"),
    ):
        store = Store.at(root / f"{keep}-{codec}").init()
        options = KvOptions(batch_size=1, kv_codec=codec)
        counts = kv_stage(
            store,
            chunks,
            model,
            prompt,
            "run-k",
            options,
            kept=kept if keep == "nuggets" else None,
        )
        assert counts.computed == 3
        out[(keep, codec)] = KvStore.open(store, counts.kv_fp)
    return out, chunks, kept


def _float_frame(ref: KvStore, chunk, spec: RopeSpec, p: int) -> torch.Tensor:
    """The float entry of ``chunk`` in the quantized stores' frame (keys at position 0): the
    codec's input, exactly (the same forward, the same rotation)."""
    return keys_to_position_zero(ref.read_entry(chunk.content_key), spec, p)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "int2mix"])
def test_entries_of_kept_ranges_hold_each_value_within_its_bound(model, stores, codec) -> None:
    by, chunks, kept = stores
    kv, ref = by[("nuggets", codec)], by[("chunks", "none")]
    assert (kv.layout.keep, kv.layout.kv_codec, kv.layout.keys_at_zero) == ("nuggets", codec, True)
    assert kv.kv_fp not in {s.kv_fp for s in by.values() if s is not kv}
    spec = RopeSpec.from_config(model.model.config)
    p = RagPrompt.for_tokenizer(model.tokenizer).n_prefix
    c = codec_named(codec)
    for chunk in chunks:
        ranges = kept[chunk.chunk_id]
        key = entry_key(chunk.content_key, ranges)
        row = kv.manifest()[key]
        assert row.kept == ranges.flat() and row.tokens == chunk.n_tokens
        assert row.bytes == kv.layout.entry_bytes(ranges.stored)  # blocks of kept tokens only
        got = kv.read_entry(key)  # (L, 2, H, stored, D), dequantized, keys at position 0
        x = ranges.cut(_float_frame(ref, chunk, spec, p)).to(torch.float64)
        assert got.shape == x.shape and got.dtype == ref.layout.torch_dtype
        half_step = codec_step_bounds(x, kv.layout.block_tokens, codec) / 2
        bound = half_step + HALF_ULP[got.dtype] * (x.abs() + half_step)
        if codec not in ("int2", "int2mix"):  # clipped ranges: the bound per group and layer
            assert ((got.to(torch.float64) - x).abs() <= bound).all()
        diff, norm = _layer_errors(got, x)
        rounding = ROUNDING * HALF_ULP[got.dtype]
        value_group = kv.layout.block_tokens if codec == "int2mix" else kv.layout.head_dim
        allowed = half_step.pow(2).flatten(2).sum(2).sqrt() + rounding * norm
        assert (diff <= allowed).all(), (diff / norm).max(dim=0)
        assert (
            diff[:, 0] / norm[:, 0] <= c.relative_error_bound(kv.layout.block_tokens) + rounding
        ).all()
        assert (diff[:, 1] / norm[:, 1] <= c.relative_error_bound(value_group) + rounding).all()
    # a range outside the kept ones is never served
    with pytest.raises(UnstoredKvSlice, match='kv_keep = "nuggets"'):
        kv.read_slices([(chunks[0].content_key, 10, 22)])  # crosses the gap [12, 20)


def test_coinrag_contexts_against_whole_chunks_of_the_same_codec_and_the_float_store(
    model, stores
) -> None:
    """Nugget slices assembled at new contiguous positions, from the nuggets+int4 store and
    from the chunks+int4 store: values the same bits; keys the same bits for block-aligned kept
    ranges; each context within the stated bound of the float store's; and the re-rotation
    contract for the nuggets store's slices."""
    by, chunks, kept = stores
    nug, whole, ref = by[("nuggets", "int4")], by[("chunks", "int4")], by[("chunks", "none")]
    spec = RopeSpec.from_config(model.model.config)
    p = RagPrompt.for_tokenizer(model.tokenizer).n_prefix
    requests = [(chunks[i].content_key, s, e) for i, s, e in REQUESTS]
    prefix_kv, _ = ref.read_prefix()
    assert torch.equal(prefix_kv, nug.read_prefix()[0])  # C_p always stored as computed
    total = p + sum(e - s for _, s, e in REQUESTS)
    contexts = {}
    for name, store in (("nug", nug), ("whole", whole), ("float", ref)):
        blocks = store.read_slices(requests)
        slices = [
            KvSlice(b, p + s, p + chunks[i].n_tokens, store.layout.keys_at_zero)
            for b, (i, s, _) in zip(blocks, REQUESTS, strict=True)
        ]
        contexts[name] = assemble_context(prefix_kv, slices, spec, new_seq_len=total + 4)
    ctx = contexts["nug"]
    assert ctx.shape == contexts["whole"].shape == contexts["float"].shape
    # values (per token): the same bits; keys: the same bits where the blocks line up
    assert torch.equal(ctx[:, 1], contexts["whole"][:, 1])
    levels = codec_named("int4").levels
    bound_sq = {n: torch.zeros(nug.layout.layers, 2, dtype=torch.float64) for n in ("nug", "whole")}
    start = p
    for i, s, e in REQUESTS:
        n, chunk, ranges = e - s, chunks[i], kept[chunks[i].chunk_id]
        here = slice(start, start + n)
        if i in ALIGNED:
            assert torch.equal(ctx[:, 0, :, here], contexts["whole"][:, 0, :, here])
        pre = _float_frame(ref, chunk, spec, p)
        offset = ranges.locate(s, e)
        block = nug.layout.block_tokens
        steps = step_bounds(ranges.cut(pre), block, levels)[:, :, :, offset : offset + n]
        bound_sq["nug"] += (steps / 2).pow(2).flatten(2).sum(2)
        steps = step_bounds(pre, whole.layout.block_tokens, levels)[:, :, :, s:e]
        bound_sq["whole"] += (steps / 2).pow(2).flatten(2).sum(2)
        # the contract: the dequantized kept entry's keys, rotated from 0 to the new positions
        deq = nug.read_entry(entry_key(chunk.content_key, ranges))[:, :, :, offset : offset + n]
        expected = rerotate_keys(
            deq[:, 0],
            torch.zeros(n, dtype=torch.long),
            torch.arange(start, start + n),
            spec,
            old_seq_len=p + chunk.n_tokens,
            new_seq_len=total + 4,
        )
        assert torch.equal(ctx[:, 0, :, here], expected)
        assert torch.equal(ctx[:, 1, :, here], deq[:, 1])
        start += n
    for name in ("nug", "whole"):
        diff, norm = _layer_errors(contexts[name], contexts["float"])
        allowed = bound_sq[name].sqrt() + ROUNDING * HALF_ULP[prefix_kv.dtype] * norm
        assert (diff <= allowed).all(), (name, (diff / norm).max(dim=0))


def test_the_context_decoded_into_place_equals_the_general_assembly(model, stores) -> None:
    """``StoredKvContext.build`` decodes each slice straight into ``C_ctx`` and rotates all
    keys at once; the general path (``ContextBuilder.build``: a tensor per slice, a rotation
    per slice) gives the same bits, for every store here (whole chunks and kept ranges, the
    float and the quantized codecs), aligned and unaligned (``coinrag-noalign``), in inference
    and in grad mode; dynamic NTK RoPE takes the general path."""
    from coinrag.inference.context.builders import ContextBuilder, StoredKvContext, UnalignedContext
    from coinrag.inference.retrieval.retriever import Evidence

    by, chunks, _ = stores
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    evidence = [
        Evidence(chunks[i].chunk_id, "d", chunks[i].content_key, s, e, "", 0.0)
        for i, s, e in [*REQUESTS, (0, 5, 5)]  # an empty span too
    ]
    for kv in by.values():
        stored = StoredKvContext(kv.store, model.model, prompt, kv)
        for builder in (stored, UnalignedContext.sharing(stored)):
            with torch.inference_mode():
                got, total = builder.build(evidence, 4)
                plain, plain_total = ContextBuilder.build(builder, evidence, 4)
            frozen, _ = builder.build(evidence, 4)  # grad mode on: fine-tuning's frozen context
            assert total == plain_total == got.shape[-2]
            assert torch.equal(got, plain) and torch.equal(got, frozen)
            assert not frozen.requires_grad
    requests = [(e.content_key, e.tok_start, e.tok_end) for e in evidence]
    with pytest.raises(ValueError, match="need"):  # a wrong shape or dtype says what it needs
        kv.read_slices_into(requests, torch.empty(1, dtype=kv.layout.torch_dtype))


def test_resident_slices_give_the_bits_of_the_host_path(model, stores) -> None:
    """``kv_resident_bytes`` (on a GPU; here its gather and assembly on the CPU): the slices a
    question lacks read into one buffer, kept, the context assembled from kept and read ones;
    the same bits as ``StoredKvContext.build``'s host path, aligned and unaligned. A second
    question reads nothing from the store; a budget smaller than one question's slices drops
    the least recently used and still gives the same bits. Dynamic NTK RoPE takes the general
    path (nothing kept)."""
    from coinrag.inference.context.builders import StoredKvContext, UnalignedContext
    from coinrag.inference.model.kv_transfer import ResidentKv
    from coinrag.inference.retrieval.retriever import Evidence

    by, chunks, _ = stores
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    evidence = [
        Evidence(chunks[i].chunk_id, "d", chunks[i].content_key, s, e, "", 0.0)
        for i, s, e in [*REQUESTS, (0, 5, 5)]
    ]
    for kv in by.values():
        stored = StoredKvContext(kv.store, model.model, prompt, kv)
        assert stored.resident is None  # a CPU: the host path
        for builder in (stored, UnalignedContext.sharing(stored)):
            with torch.inference_mode():
                want, total = builder.build(evidence, 4)
                per_token = math.prod(kv.layout.entry_shape(1)) * want.element_size()
                half = per_token * sum(e.tok_end - e.tok_start for e in evidence) // 2
                for budget in (10**9, half):
                    builder.resident = ResidentKv(budget)
                    timings: dict[str, float] = {}
                    first, first_total = builder.build(evidence, 4, timings)
                    again, _ = builder.build(evidence, 4)
                    assert torch.equal(first, want) and torch.equal(again, want)
                    assert first_total == total and set(timings) == {"kv_load", "assembly"}
                    if builder.spec.seq_len_dependent:  # dynamic NTK: the general path
                        assert builder.resident.hits == builder.resident.misses == 0
                    elif budget == 10**9:
                        assert builder.resident.hits == len(evidence)  # the second question
                        assert len(builder.resident) == len(evidence)
                    else:
                        assert builder.resident.bytes <= budget
                builder.resident = None


def test_gc_moves_entries_of_kept_ranges_bit_for_bit(stores, tmp_path) -> None:
    """``reclaim`` of a nuggets+int4 store moves the live entries as stored (never
    re-encoded): a copy of the store, one entry dropped."""
    import shutil

    by, chunks, kept = stores
    src = by[("nuggets", "int4")]
    root = tmp_path / "copy"
    shutil.copytree(src.store.require_local("a copy"), root)
    kv = KvStore.open(Store.at(root), src.kv_fp)
    keys = list(kv.manifest())
    before = {k: kv.read_stored(k) for k in keys}
    live = set(keys[1:])
    done = kv.reclaim(live, "run-gc")
    assert done.entries_moved >= 1 and done.entries_corrupt == 0
    fresh = KvStore.open(Store.at(root), src.kv_fp)
    assert set(fresh.manifest()) == live
    for key in live:
        assert np.array_equal(fresh.read_stored(key), before[key])
        assert fresh.manifest()[key].kept == kv.manifest()[key].kept


# ---------------------------------------------------------------------------- end to end


@pytest.mark.heavy  # over 15 s: the second tier keeps the default run under 15 min
@pytest.mark.usefixtures("prefect_harness")
def test_build_nuggets_int4_and_answer_coinrag_like_chunks_int4(
    tmp_path, smollm2_tokenizer, sample_corpus
) -> None:
    """``coinrag build --kv-keep nuggets --kv-codec int4`` (the CLI) next to whole chunks in
    int4 and in none (``build_flow``; same corpus, model, dtype and batches): coinrag's
    context from ``RagEngine`` has the same values as the chunks+int4 store's and keys within
    the stated bound of the float store's; queries work, turborag is refused naming the
    setting, an unchanged rebuild computes nothing, gc keeps what coinrag reads."""
    source = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    model = save_tiny_llama(tmp_path / "llama", smollm2_tokenizer, 5)
    settings = {"extractor": "rules", "model": str(model), "chunk_size": 64}
    settings |= {"kv_dtype": "bfloat16", "kv_batch_size": 1}
    build_flow(str(source), str(tmp_path / "none"), settings)
    build_flow(str(source), str(tmp_path / "int4"), {**settings, "kv_codec": "int4"})
    config = tmp_path / "build.toml"
    config.write_text(
        "[build]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    )
    store = tmp_path / "nuggets-int4"
    args = ["build", str(source), "--store", str(store), "--config", str(config)]
    result = CliRunner().invoke(app, [*args, "--kv-keep", "nuggets", "--kv-codec", "int4"])
    assert result.exit_code == 0, result.output
    st = Store.at(store)
    (fp,) = kv_fps(st)
    kv = KvStore.open(st, fp)
    assert (kv.layout.keep, kv.layout.kv_codec, kv.layout.keys_at_zero) == ("nuggets", "int4", True)
    nuggets = read_rows(st, NuggetRow)
    assert {r.content_key for r in kv.manifest().values()} == {n.content_key for n in nuggets}

    engines = {
        name: RagEngine.open(str(tmp_path / name), max_new_tokens=4)
        for name in ("nuggets-int4", "int4", "none")
    }
    evidence = engines["nuggets-int4"].retrieve(QUESTION, "coinrag", kc=3, k=6).evidence
    assert evidence
    ctx = {n: e.asset(StoredNuggetKv).build(evidence, 9) for n, e in engines.items()}
    assert ctx["nuggets-int4"][1] == ctx["int4"][1] == ctx["none"][1]
    got, whole, flt = (ctx[n][0] for n in ("nuggets-int4", "int4", "none"))
    assert got.dtype == torch.bfloat16 and torch.equal(got[:, 1], whole[:, 1])
    # keys: within the stated bound of the float context, for the blocks each entry stores
    ref = engines["none"].asset(StoredNuggetKv).kv
    spec = RopeSpec.from_config(engines["none"].model.config)
    p = engines["none"].prompt.n_prefix
    block, levels = kv.layout.block_tokens, codec_named("int4").levels
    bound_sq = torch.zeros(kv.layout.layers, 2, dtype=torch.float64)
    for e in evidence:
        ranges = KeptRanges.of_spans(
            (n.tok_start, n.tok_end) for n in nuggets if n.content_key == e.content_key
        )
        pre = keys_to_position_zero(ref.read_entry(e.content_key), spec, p)
        offset = ranges.locate(e.tok_start, e.tok_end)
        n = e.tok_end - e.tok_start
        steps = step_bounds(ranges.cut(pre), block, levels)[:, :, :, offset : offset + n]
        bound_sq += (steps / 2).pow(2).flatten(2).sum(2)
    diff, norm = _layer_errors(got, flt)
    allowed = bound_sq.sqrt() + ROUNDING * HALF_ULP[torch.bfloat16] * norm
    assert (diff <= allowed).all(), diff / norm

    cli = CliRunner()
    ok = cli.invoke(
        app, ["query", QUESTION, "--store", str(store), "--json", "--max-new-tokens", "3"]
    )
    assert ok.exit_code == 0, ok.output
    answer = json.loads(ok.stdout.strip().splitlines()[-1])
    assert answer["evidence"] and answer["timings"]["kv_load"] > 0
    bad = cli.invoke(app, ["query", QUESTION, "--store", str(store), "--method", "turborag"])
    assert bad.exit_code == 1 and bad.output.count("error:") == 1
    assert 'kv_keep = "nuggets"' in bad.output
    again = build_flow(
        str(source), str(store), {**settings, "kv_keep": "nuggets", "kv_codec": "int4"}
    )
    assert again["kv_computed"] == 0 and again["kv_reused"] == len(kv.manifest())
    assert cli.invoke(app, ["gc", "--store", str(store)]).exit_code == 0
    fresh = KvStore.open(st, fp)
    requests = [(e.content_key, e.tok_start, e.tok_end) for e in evidence]
    for a, b in zip(fresh.read_slices(requests), kv.read_slices(requests), strict=True):
        assert torch.equal(a, b)
