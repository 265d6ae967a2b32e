"""``kv_codec = int2basis`` (issue 36): ``int2mix``'s payload with the keys coded in the store's
calibrated key basis (``storage/kv/basis.py``, ``storage/kv/mixed.py``).

The bounds, held against the float entry:

- the basis: ``forward @ inverse = I`` within float32 rounding, and the calibration keys'
  coordinates uncorrelated with their variance in descending order;
- per layer, keys: in coordinate space ``int2mix``'s bound at the codec's key counts
  (``mixed_step_bounds`` of the coordinates of the float entry), carried back per head by
  ``‖inverse_h‖₂``: ``‖k̂ − k‖² <= Σ_h ‖inverse_h‖₂² Σ (step / 2)²``; values as
  ``int2mix``'s; plus ``ROUNDING`` half-ulps of the model dtype and float32's rounding of the
  product;
- per layer, relative: keys within ``relative_error_bound_in_basis`` (``int2mix``'s bound times
  the basis's condition), values within ``int2mix``'s.

Oracles as ``test_kv_codecs.py``: transformers' own cache for whole chunks (turborag), the
float store's context for nugget slices (coinrag), and the re-rotation contract (a slice is the
decoded entry's keys rotated to its new positions, bit for bit). On SmolLM2 (bfloat16) and tiny
random Qwen2, Llama and Qwen3 (whose queries are read after ``q_norm``).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from itertools import accumulate

import httpx
import numpy as np
import pytest
import torch
from model_families import FAMILIES, family_model
from store_fixtures import random_ids, sample_docs, save_tiny_llama, synthetic_chunk, write_corpus
from test_kv_codecs import (
    HALF_ULP,
    MODELS,
    ROUNDING,
    _layer_errors,
    _own_cache,
    _synthetic,
    _tiny,
    _within,
    codec_chunks,
    mixed_step_bounds,
)
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.flows.verify import verify_store
from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.model.calibrate import key_statistics, query_modules
from coinrag.inference.model.encode import keys_to_position_zero
from coinrag.inference.model.loading import LoadedModel
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import RopeSpec, model_rope, rerotate_keys
from coinrag.schemas.tables import RunRow
from coinrag.storage.kv import CorruptKvEntry, KvError, KvLayout, KvStore, codec_named
from coinrag.storage.kv.basis import KeyBasis, calibrated_basis
from coinrag.storage.kv.layout import parse_location
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.kv import CALIBRATION_CHUNKS, KvOptions, calibration_chunks, kv_stage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------- the basis


def test_the_docstring_example() -> None:
    keys = torch.tensor([[[[1.0, 0.0], [3.0, 0.0]]]])  # (L 1, H 1, T 2, D 2)
    basis = calibrated_basis(torch.tensor([[[2.0, 1.0]]]), [keys])
    assert torch.allclose(basis.forward.abs(), torch.diag(torch.tensor([2.0, 1.0]))[None, None])
    coordinates = basis.to_coordinates(keys)
    assert torch.allclose(coordinates.abs(), torch.tensor([[[[2.0, 0.0], [6.0, 0.0]]]]))
    assert torch.allclose(basis.from_coordinates(coordinates), keys)


def test_a_calibrated_basis_inverts_and_orders_the_weighted_spread() -> None:
    g = torch.Generator().manual_seed(3)
    mix = torch.randn(2, 3, 16, 16, generator=g)
    keys = [torch.randn(2, 3, n, 16, generator=g) @ mix for n in (40, 70)]
    w = torch.rand(2, 3, 16, generator=g) * 4 + 0.1
    w[1, 2, 5] = 0.0  # a channel no query reads: the head's smallest weight instead
    basis = calibrated_basis(w, keys)
    eye = torch.eye(16).expand(2, 3, 16, 16)
    assert torch.allclose(basis.forward @ basis.inverse, eye, atol=1e-5)
    c = basis.to_coordinates(torch.cat(keys, dim=2)).double()
    c = c - c.mean(2, keepdim=True)
    cov = c.transpose(-1, -2) @ c / c.shape[2]
    var = cov.diagonal(dim1=-2, dim2=-1)
    assert (var[..., :-1] >= var[..., 1:] * (1 - 1e-5)).all()  # largest first
    off = cov - torch.diag_embed(var)
    assert off.abs().max() <= 1e-4 * var.max()
    # ‖forward‖‖inverse‖ = max w / min w (R orthogonal)
    floor = torch.where(w > 0, w, torch.inf).amin(-1)
    assert torch.allclose(basis.condition(), w.amax(-1) / floor, rtol=1e-4)
    with pytest.raises(ValueError, match="calibration keys"):
        calibrated_basis(w, [])


@pytest.mark.parametrize("dim", [8, 16, 48, 64, 80, 128, 256])
def test_the_basis_product_is_exact_where_it_can_be_and_independent_of_the_tokens(dim) -> None:
    """``kernels.basis_rows`` (two ``fma`` chains a value; vectors of 64 then 16 columns where
    ``D`` is a multiple of 16, a scalar loop for the tiny configs' 8): on dyadic values, whose
    every sum is exact in float32, the float64 product itself (every tile and column placed);
    on random ones within float32's rounding of it, and each token's bits those of that token
    decoded alone."""
    from coinrag.storage.kv.kernels import basis_rows

    rng = np.random.default_rng(dim)
    c = rng.integers(-64, 65, (2, 3, 7, dim)).astype(np.float32) / 8
    m = rng.integers(-64, 65, (2, 3, dim, dim)).astype(np.float32) / 8
    out = np.empty_like(c)
    basis_rows(c, m, out)
    assert np.array_equal(out, np.einsum("lhti,lhij->lhtj", c.astype(np.float64), m))
    c = rng.standard_normal((2, 3, 7, dim)).astype(np.float32)
    m = rng.standard_normal((2, 3, dim, dim)).astype(np.float32)
    basis_rows(c, m, out)
    exact = np.einsum("lhti,lhij->lhtj", c.astype(np.float64), m.astype(np.float64))
    scale = np.einsum("lhti,lhij->lhtj", np.abs(c).astype(np.float64), np.abs(m))
    assert (np.abs(out - exact) <= dim * 2**-24 * scale).all()  # dim roundings of each term
    alone = np.empty((2, 3, 1, dim), np.float32)
    for t in range(7):
        basis_rows(np.ascontiguousarray(c[:, :, t : t + 1]), m, alone)
        assert np.array_equal(alone[:, :, 0].view(np.uint32), out[:, :, t].view(np.uint32))


def test_a_layout_pickles_with_its_basis_not_its_loader(tmp_path) -> None:
    layout = KvLayout("m", "p", 3, 2, 8, "bfloat16", 16, 4, "int2basis")
    kv = KvStore.create(Store.at(tmp_path / "s").init(), layout)
    with pytest.raises(KvError, match="no key basis"):
        layout.key_basis.get()
    basis = _basis_of(layout)
    kv.key_basis.write(basis, {"chunks": []})
    back = pickle.loads(pickle.dumps(layout))
    assert back == layout and torch.equal(back.key_basis.get().forward, basis.forward)
    assert dataclasses.replace(layout, block_tokens=8).key_basis is layout.key_basis
    with pytest.raises(KvError, match="written once"):
        kv.key_basis.write(basis, {})


def _basis_of(layout: KvLayout, seed: int = 0) -> KeyBasis:
    """A basis calibrated on synthetic keys of ``layout``'s dims (weights 0.5-2.5)."""
    g = torch.Generator().manual_seed(seed)
    keys = _synthetic(64, torch.float32, seed)[:, 0]
    w = torch.rand(layout.layers, layout.kv_heads, layout.head_dim, generator=g) * 2 + 0.5
    return calibrated_basis(w, [keys])


# ---------------------------------------------------------------------------- the store


def _basis_store(tmp_path, name: str = "s", dtype: str = "bfloat16") -> tuple[KvStore, list]:
    layout = KvLayout("model-x", "ps-x", 3, 2, 8, dtype, 8, 3, "int2basis")
    kv = KvStore.create(Store.at(tmp_path / name).init(), layout)
    kv.key_basis.write(_basis_of(layout), {"chunks": ["synthetic"]})
    entries = [
        (synthetic_chunk(i, n), _synthetic(n, torch.float32, i))
        for i, n in enumerate([37, 40, 5, 33])
    ]
    kv.write_entries(entries, "run-b")
    return kv, entries


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_the_store_reads_what_the_codec_decodes_on_every_path(tmp_path, dtype) -> None:
    """``read_entry`` (the tensor path, whole blocks), ``read_slices`` (bfloat16 and float32:
    the compiled decode, each key turned back from the basis as it is placed; float16: the
    tensor path, span by span) and a fresh store's reads (the basis loaded from disk) give the
    same bits, and so does ``read_slices_into`` with a rope of angle 0 (the compiled decode
    rotates after the basis; the tensor path leaves the rotation to the caller)."""
    kv, entries = _basis_store(tmp_path, dtype=dtype)
    fresh = KvStore.open(kv.store, kv.kv_fp)
    assert fresh.layout.key_basis is not kv.layout.key_basis
    requests = []
    for chunk, tensor in entries:
        whole = kv.read_entry(chunk.content_key)
        assert torch.equal(fresh.read_entry(chunk.content_key), whole)
        diff, norm = _layer_errors(whole, tensor)
        assert (diff / norm).max() < 0.5  # a 2-bit code, not noise (bounds: the model tests)
        n = chunk.n_tokens
        spans = sorted({(0, n), (n - 1, n), (3, 5), (2, n)})
        requests += [(chunk.content_key, s, e) for s, e in spans if 0 <= s <= e <= n]
    for reader in (kv, fresh):
        for (ck, s, e), got in zip(requests, reader.read_slices(requests), strict=True):
            assert torch.equal(got, kv.read_entry(ck)[:, :, :, s:e]), (ck, s, e)
    total = sum(e - s for _, s, e in requests)
    half = kv.layout.head_dim // 2
    rope = (np.ones((total, half), np.float32), np.zeros((total, half), np.float32))
    out = torch.empty(kv.layout.entry_shape(total), dtype=kv.layout.torch_dtype)
    compiled = dtype != "float16"  # the compiled decode rotates as it places (identity here)
    assert kv.read_slices_into(requests, out, rope=rope) is compiled
    starts = list(accumulate([0, *(e - s for _, s, e in requests)]))[:-1]
    for (ck, s, e), at in zip(requests, starts, strict=True):
        assert torch.equal(out[:, :, :, at : at + e - s], kv.read_entry(ck)[:, :, :, s:e])


def test_a_basis_store_without_its_basis_is_refused_and_a_damaged_one_found(tmp_path) -> None:
    layout = KvLayout("model-x", "ps-x", 3, 2, 8, "bfloat16", 8, 3, "int2basis")
    bare = KvStore.create(Store.at(tmp_path / "bare").init(), layout)
    with pytest.raises(KvError, match="no key basis"):
        bare.write_entries([(synthetic_chunk(0, 9), _synthetic(9, torch.float32))], "r")
    kv, _ = _basis_store(tmp_path)
    assert kv.key_basis.problem() is None
    (data,) = [p for p in (kv.root / "basis").rglob("*") if p.is_file() and p.name != "zarr.json"]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x10
    data.write_bytes(bytes(raw))
    fresh = KvStore.open(kv.store, kv.kv_fp)
    assert "crc32c" in (fresh.key_basis.problem() or "")
    (row,) = [c for c in verify_store(str(kv.store.root)).corrupt if c.content_key == "basis"]
    assert row.problem.endswith(f"({kv.kv_fp}/basis)")


# ---------------------------------------------------------------------------- models


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "smollm2"])
def model(request, smollm2_tokenizer) -> LoadedModel:
    if request.param == "smollm2":
        from coinrag.inference.model.loading import load_model

        return load_model(None, dtype="bfloat16")
    return _tiny(request.param, smollm2_tokenizer, **MODELS[request.param])


@pytest.fixture(scope="module")
def stores(model, tmp_path_factory):
    """The same chunks stored by ``model`` as ``none`` and ``int2basis``."""
    chunks = codec_chunks(model.tokenizer)
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    out = {}
    root = tmp_path_factory.mktemp("basis")
    for codec in ("none", "int2basis"):
        store = Store.at(root / codec).init()
        counts = kv_stage(
            store, chunks, model, prompt, "run-c", KvOptions(batch_size=1, kv_codec=codec)
        )
        assert counts.computed == 3
        assert counts.basis_written == ("new" if codec == "int2basis" else "")
        out[codec] = (KvStore.open(store, counts.kv_fp), chunks)
    return out


def test_the_basis_is_calibrated_on_the_stores_chunks_and_the_queries_before_rope(
    model, stores
) -> None:
    kv, chunks = stores["int2basis"]
    recorded = kv.key_basis.calibration()
    assert recorded["chunks"] == sorted(c.content_key for c in chunks)
    assert recorded["tokens"] == sum(c.n_tokens for c in chunks)
    family = model.model.config.model_type
    assert recorded["queries"] == ("q_norm" if family == "qwen3" else "q_proj")
    assert query_modules(model.model)[0] == recorded["queries"]
    # what was stored is what calibration computes, and the store reads it back
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    stats = key_statistics(model.model, prompt, [c.token_ids for c in sorted(chunks, key=_ck)])
    assert stats.query_rms.shape == (kv.layout.layers, kv.layout.kv_heads, kv.layout.head_dim)
    assert (stats.query_rms > 0).all() and torch.isfinite(stats.query_rms).all()
    again = calibrated_basis(stats.query_rms, stats.keys)
    assert torch.equal(again.forward, kv.layout.key_basis.get().forward)
    # the keys calibrated on are the store's keys before RoPE: the none store's, rotated back
    ref, _ = stores["none"]
    spec = RopeSpec.from_config(model.model.config)
    for chunk, keys in zip(sorted(chunks, key=_ck), stats.keys, strict=True):
        entry = keys_to_position_zero(ref.read_entry(chunk.content_key), spec, prompt.n_prefix)
        if ref.layout.dtype == "float32":  # the same forward's bits
            assert torch.equal(keys, entry[:, 0])
        else:  # bfloat16: one forward over prefix and chunk rounds apart from the cached prefix
            diff = (keys - entry[:, 0]).flatten(1).norm(dim=1)
            assert (diff / entry[:, 0].flatten(1).norm(dim=1)).max() <= 2**-5  # SmolLM2: 0.012


def _ck(chunk) -> str:
    return chunk.content_key


def test_calibration_takes_the_lowest_content_keys_only_for_a_basis_codec(stores) -> None:
    _, chunks = stores["int2basis"]
    many = [dataclasses.replace(chunks[0], content_key=f"ck-{i:03d}") for i in range(40)]
    picked = calibration_chunks(many[::-1] + many[:5], KvOptions(kv_codec="int2basis"))
    assert [c.content_key for c in picked] == [f"ck-{i:03d}" for i in range(CALIBRATION_CHUNKS)]
    assert calibration_chunks(many, KvOptions(kv_codec="int2mix")) == []


def _key_bound_sq(kv: KvStore, pre: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """``(L, 2)``: the squared error bound of tokens ``[s, e)`` of the float entry ``pre``
    (keys at position 0): keys from their coordinates' ``int2mix`` bound, per head widened by
    ``‖inverse_h‖₂²``; values as ``int2mix``'s."""
    basis = kv.layout.key_basis.get()
    exact = pre.float().clone()
    exact[:, 0] = basis.to_coordinates(pre[:, 0].float())
    counts = kv.layout.codec.key_counts(kv.layout.head_dim)
    steps = mixed_step_bounds(exact, kv.layout.block_tokens, counts)[:, :, :, s:e]
    per_head = (steps / 2).pow(2).sum((3, 4))  # (L, 2, H)
    sigma = torch.linalg.matrix_norm(basis.inverse.double(), ord=2)  # (L, H)
    per_head[:, 0] *= sigma.square() * (1 + 2**-12)  # and float32's rounding of the product
    return per_head.sum(2)


def test_turborag_contexts_against_the_models_own_cache(model, stores) -> None:
    kv, chunks = stores["int2basis"]
    spec = RopeSpec.from_config(model.model.config)
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    prefix_kv, _ = kv.read_prefix()
    p, dtype = prompt.n_prefix, prefix_kv.dtype
    codec = codec_named("int2basis")
    condition = kv.layout.key_basis.get().condition().amax(-1)  # (L,)
    for chunk in chunks:
        n = chunk.n_tokens
        (block,) = kv.read_slices([(chunk.content_key, 0, n)])
        ctx = assemble_context(prefix_kv, [KvSlice(block, p, p + n, at_zero=True)], spec)
        own = _own_cache(model, list(prompt.prefix_ids), list(chunk.token_ids))
        assert ctx.shape == own.shape
        pre = keys_to_position_zero(own[..., p:, :], spec, p)
        _within(ctx[..., p:, :], own[..., p:, :], _key_bound_sq(kv, pre, 0, n), dtype)
        diff, norm = _layer_errors(ctx[..., p:, :], own[..., p:, :])
        rel, rounding = diff / norm, ROUNDING * HALF_ULP[dtype]
        group = kv.layout.block_tokens
        key_bounds = torch.tensor(
            [codec.relative_error_bound_in_basis(group, float(c)) for c in condition]
        )
        assert (rel[:, 0] <= key_bounds + rounding).all()
        assert (rel[:, 1] <= codec.relative_error_bound(group) + rounding).all()


def test_coinrag_contexts_against_the_float_store(model, stores) -> None:
    """Nugget slices of three chunks at new contiguous positions: within the bound of the
    float store's context; each slice the decoded entry's keys rotated there, bit for bit."""
    kv, chunks = stores["int2basis"]
    ref, _ = stores["none"]
    spec = RopeSpec.from_config(model.model.config)
    p = RagPrompt.for_tokenizer(model.tokenizer).n_prefix
    spans = [(2, 5, 19), (0, 30, 42), (1, 0, 7), (0, 3, 13), (2, 21, 30)]
    requests = [(chunks[i].content_key, s, e) for i, s, e in spans]
    prefix_kv, _ = ref.read_prefix()
    total = p + sum(e - s for _, s, e in spans)
    contexts = {}
    for name, store in (("q", kv), ("f", ref)):
        blocks = store.read_slices(requests)
        slices = [
            KvSlice(b, p + s, p + chunks[i].n_tokens, store.layout.keys_at_zero)
            for b, (i, s, _) in zip(blocks, spans, strict=True)
        ]
        contexts[name] = assemble_context(prefix_kv, slices, spec, new_seq_len=total + 4)
    bound_sq = torch.zeros(kv.layout.layers, 2, dtype=torch.float64)
    start = p
    for i, s, e in spans:
        pre = keys_to_position_zero(ref.read_entry(chunks[i].content_key), spec, p)
        bound_sq += _key_bound_sq(kv, pre, s, e)
        deq = kv.read_entry(chunks[i].content_key)
        n = e - s
        expected = rerotate_keys(
            deq[:, 0, :, s:e],
            torch.zeros(n, dtype=torch.long),
            torch.arange(start, start + n),
            spec,
            old_seq_len=p + chunks[i].n_tokens,
            new_seq_len=total + 4,
        )
        assert torch.equal(contexts["q"][:, 0, :, start : start + n], expected)
        assert torch.equal(contexts["q"][:, 1, :, start : start + n], deq[:, 1, :, s:e])
        start += n
    _within(contexts["q"], contexts["f"], bound_sq, prefix_kv.dtype)


def test_a_damaged_basis_is_replaced_and_every_entry_rebuilt(model, stores, tmp_path) -> None:
    _, chunks = stores["int2basis"]
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    store = Store.at(tmp_path / "s").init()
    options = KvOptions(batch_size=1, kv_codec="int2basis")
    first = kv_stage(store, chunks, model, prompt, "run-1", options)
    again = kv_stage(store, chunks, model, prompt, "run-2", options)
    assert (again.computed, again.reused, again.basis_written) == (0, 3, "")
    kv = KvStore.open(store, first.kv_fp)
    before = {c.content_key: kv.read_stored(c.content_key) for c in chunks}
    data = [p for p in (kv.root / "basis").rglob("*") if p.is_file() and p.name != "zarr.json"]
    raw = bytearray(data[0].read_bytes())
    raw[64] ^= 0x01
    data[0].write_bytes(bytes(raw))
    repaired = kv_stage(store, chunks, model, prompt, "run-3", options)
    assert repaired.basis_written == "replaced" and "key_basis" in repaired.problems
    assert repaired.computed == 3 and repaired.rebuilt == 3
    fresh = KvStore.open(store, first.kv_fp)
    assert fresh.key_basis.problem() is None
    for c in chunks:  # the same basis recalibrated on the same chunks: the same bytes
        assert np.array_equal(fresh.read_stored(c.content_key), before[c.content_key])


def test_a_flipped_byte_in_a_block_is_found_and_the_build_repairs_it(
    model, stores, tmp_path
) -> None:
    """A block of an ``int2basis`` entry with a flipped byte fails its crc32c on a slice read
    and on the check before reuse; the next KV stage rebuilds that entry alone (the basis
    stays) and it reads back as before."""
    _, chunks = stores["int2basis"]
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    store = Store.at(tmp_path / "s").init()
    options = KvOptions(batch_size=1, kv_codec="int2basis")
    first = kv_stage(store, chunks, model, prompt, "run-1", options)
    kv = KvStore.open(store, first.kv_fp)
    ck = chunks[0].content_key
    before = kv.read_entry(ck)
    shard = kv._shard(parse_location(kv.manifest()[ck].location)[1])
    data = kv.root / shard.name / shard.data_key
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01  # slot 0, block 0
    data.write_bytes(bytes(raw))
    fresh = KvStore.open(store, first.kv_fp)
    with pytest.raises(CorruptKvEntry, match="block 0 fails its crc32c"):
        fresh.read_slices([(ck, 0, 3)])
    assert set(fresh.entry_problems(fresh.manifest(), "crc32c")) == {ck}
    repaired = kv_stage(store, chunks, model, prompt, "run-2", options)
    assert (repaired.rebuilt, repaired.computed, repaired.basis_written) == (1, 1, "")
    assert torch.equal(KvStore.open(store, first.kv_fp).read_entry(ck), before)


@pytest.mark.heavy  # over 10 s: the second tier
@pytest.mark.usefixtures("prefect_harness")
def test_build_query_and_serve_with_int2basis(tmp_path, smollm2_tokenizer, sample_corpus) -> None:
    """``coinrag build --kv-codec int2basis`` stores a key basis and answers from it: coinrag,
    turborag, cacheblend and an ablation by ``coinrag query``, coinrag and turborag by the API
    server alike; ``verify`` passes."""
    from api_harness import serving

    from coinrag.inference.server.app import ServerConfig

    source = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    model = save_tiny_llama(tmp_path / "llama", smollm2_tokenizer, 5)
    store = tmp_path / "store"
    build = ["build", str(source), "--store", str(store), "--extractor", "rules", "--model"]
    build += [str(model), "--chunk-size", "64", "--kv-dtype", "bfloat16"]
    result = CliRunner().invoke(app, [*build, "--kv-codec", "int2basis"])
    assert result.exit_code == 0, result.output
    (run,) = [r for r in read_rows(Store.at(store), RunRow) if r.status == "completed"]
    kv = KvStore.open(Store.at(store), json.loads(run.fingerprints_json)["kv_fp"])
    assert json.loads(run.counts_json)["kv_basis"] == "new"
    assert kv.layout.kv_codec == "int2basis" and kv.key_basis.problem() is None
    assert kv.key_basis.calibration()["queries"] == "q_proj"
    assert verify_store(str(store)).corrupt == []
    question = "Who directed 2001: A Space Odyssey?"
    answers = {}
    for method in ("coinrag", "turborag", "cacheblend", "coinrag-onestage"):
        result = CliRunner().invoke(
            app,
            ["query", question, "--store", str(store), "--method", method, "--kc", "2", "--k"]
            + ["4", "--max-new-tokens", "4", "--json", "--threads", "1"],
        )
        assert result.exit_code == 0, result.output
        answers[method] = json.loads(result.stdout.strip().splitlines()[-1])
        assert answers[method]["evidence"] and answers[method]["timings"]["kv_load"] > 0
    config = ServerConfig(
        store=str(store), methods=("coinrag", "turborag"), max_new_tokens=4,
        settings={"threads": 1},
    )  # fmt: skip
    with serving(config) as (base, _), httpx.Client(timeout=120) as client:
        for method, cli in list(answers.items())[:2]:
            body = {"question": question, "method": method, "kc": 2, "k": 4}
            served = client.post(f"{base}/query", json=body)
            assert served.status_code == 200, served.text
            assert served.json()["answer"] == cli["answer"]
            assert served.json()["evidence"] == cli["evidence"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_of_the_matrix_calibrates_and_holds_the_bound(family: str) -> None:
    """Each family of the model matrix (``tests/model_families.py``, float32): a basis
    calibrated on two texts after a prefix, its queries read where the family computes them
    before RoPE (``q_norm`` for Qwen3, OLMo 2 and Gemma 3, ``q_proj`` for the others, weights
    of 1 where the attention has neither: GPT-NeoX's and Phi-3's fused projections), and a
    chunk's KV round-tripped by ``int2basis`` within the per-layer bound."""
    from coinrag.inference.model.calibrate import calibrated_key_basis
    from coinrag.inference.model.encode import compute_chunk_kv, compute_prefix_kv

    model = family_model(family, "eager")
    prefix = random_ids(6, 1)
    prompt = RagPrompt(None, "", "", prefix, "sha-x", False)
    texts = [random_ids(40, 11), random_ids(33, 12)]
    basis, source = calibrated_key_basis(model, prompt, texts)
    layers = {"qwen3": "q_norm", "olmo2": "q_norm", "gemma3": "q_norm"}
    assert source == layers.get(family, "none" if family in ("gpt_neox", "phi3") else "q_proj")
    eye = torch.eye(basis.shape[2]).expand_as(basis.forward)
    assert torch.allclose(basis.forward @ basis.inverse, eye, atol=1e-4)
    chunk = random_ids(45, 13)
    prefix_kv = compute_prefix_kv(model, prefix)
    row = dataclasses.replace(synthetic_chunk(0, len(chunk)), token_ids=chunk)
    (kv,) = compute_chunk_kv(model, prefix_kv, [row], pad_id=0)
    pre = keys_to_position_zero(kv, model_rope(model.config), len(prefix))
    layout = KvLayout("m", "p", *basis.shape[:2], basis.shape[2], "float32", 16, 4, "int2basis")
    layout.key_basis.set(basis)
    codec = layout.codec
    got = codec.decode(codec.encode(pre, layout), layout)[:, :, :, : len(chunk)]
    store = type("Bound", (), {"layout": layout})()
    _within(got, pre, _key_bound_sq(store, pre, 0, len(chunk)), torch.float32)
