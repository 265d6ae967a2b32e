"""Prefix assembly and generation against transformers' own computation (the oracle).

Chunks are encoded as the KV stage encodes them: right after the prompt prefix ``p``, keeping
only the chunk's part of the cache. Then:

3. ``turborag`` with one chunk gives the next-token logits that ``standard`` (one forward over
   prefix + chunk + query) gives;
4. ``coinrag`` whose nugget slices cover a chunk contiguously equals ``turborag`` on that chunk;
5. generation from an assembled cache equals generation from the cache built in memory.

Tolerance for 3 (fp32): the cached path and the single forward do the same arithmetic in
different orders (attention over a concatenated cache vs one causal matmul), so logits differ
by float32 rounding only: max |Δlogit| <= LOGIT_ATOL_FP32 (measured: 3.6e-5 on SmolLM2 with
logits of magnitude ~20, 1-2e-7 on the tiny random models).
"""

from __future__ import annotations

import pytest
import torch
from store_fixtures import TINY_DIMS
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.model.encode import from_cache, to_dynamic_cache
from coinrag.inference.model.generate import prefill_and_decode
from coinrag.inference.rope import RopeSpec

LOGIT_ATOL_FP32 = 2e-4

_SMALL = dict(
    **TINY_DIMS,
    vocab_size=500,
    max_position_embeddings=4096,
)


def _configs():
    return {
        "qwen2": Qwen2Config(**_SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "llama3": LlamaConfig(
            **_SMALL,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        ),
        "qwen3": Qwen3Config(
            **_SMALL, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        ),
    }


@pytest.fixture(scope="module", params=["qwen2", "llama3", "qwen3", "smollm2"])
def model_and_vocab(request):
    if request.param == "smollm2":
        from coinrag.inference.model.loading import load_model

        loaded = load_model(None)
        return loaded.model, loaded.tokenizer, 49152
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_configs()[request.param], dtype=torch.float32).eval()
    from coinrag.inference.model.loading import load_tokenizer

    return model, load_tokenizer(None), 500


def _encode_chunk(model, prefix: list[int], chunk: list[int]) -> torch.Tensor:
    """The KV stage's encoding: forward(prefix + chunk), keep the chunk part."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prefix + chunk]), use_cache=True)
    return from_cache(out.past_key_values)[..., len(prefix) :, :]


def _prefix_kv(model, prefix: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prefix]), use_cache=True)
    return from_cache(out.past_key_values)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_turborag_single_chunk_equals_standard(model_and_vocab) -> None:
    model, tok, vocab = model_and_vocab
    prefix, chunk, query = _ids(vocab, 7, 1), _ids(vocab, 40, 2), _ids(vocab, 6, 3)
    spec = RopeSpec.from_config(model.config)
    ctx = assemble_context(
        _prefix_kv(model, prefix),
        [KvSlice(_encode_chunk(model, prefix, chunk), len(prefix), len(prefix) + len(chunk))],
        spec,
    )
    turbo = prefill_and_decode(
        model,
        tok,
        to_dynamic_cache(ctx, model.config),
        ctx.shape[-2],
        query,
        max_new_tokens=1,
        keep_first_logits=True,
    )
    standard = prefill_and_decode(
        model, tok, None, 0, prefix + chunk + query, max_new_tokens=1, keep_first_logits=True
    )
    diff = (turbo.first_logits - standard.first_logits).abs().max().item()
    assert diff <= LOGIT_ATOL_FP32, diff
    assert turbo.token_ids[:1] == standard.token_ids[:1] or not standard.token_ids


def test_coinrag_covering_slices_equal_turborag(model_and_vocab) -> None:
    model, _, vocab = model_and_vocab
    prefix, chunk = _ids(vocab, 5, 4), _ids(vocab, 30, 5)
    spec = RopeSpec.from_config(model.config)
    kv = _encode_chunk(model, prefix, chunk)
    p = len(prefix)
    whole = assemble_context(_prefix_kv(model, prefix), [KvSlice(kv, p, p + 30)], spec)
    cuts = [(0, 7), (7, 19), (19, 30)]
    sliced = assemble_context(
        _prefix_kv(model, prefix),
        [KvSlice(kv[..., s:e, :], p + s, p + 30) for s, e in cuts],
        spec,
    )
    assert torch.equal(whole, sliced)


def test_rotated_slice_lands_where_the_model_would_put_it(model_and_vocab) -> None:
    """A nugget slice moved forward: layer-0 keys equal the model's at the new positions."""
    model, _, vocab = model_and_vocab
    prefix, chunk = _ids(vocab, 5, 6), _ids(vocab, 30, 7)
    spec = RopeSpec.from_config(model.config)
    kv = _encode_chunk(model, prefix, chunk)
    p = len(prefix)
    ctx = assemble_context(
        _prefix_kv(model, prefix), [KvSlice(kv[..., 12:20, :], p + 12, p + 30)], spec
    )
    # The model's own layer-0 keys for the same tokens standing right after the prefix.
    ref = _encode_chunk(model, prefix, chunk[12:20])
    got, want = ctx[0, 0, :, p:, :], ref[0, 0]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_generation_from_assembled_cache_equals_in_memory_cache(model_and_vocab) -> None:
    model, tok, vocab = model_and_vocab
    prefix, chunk, query = _ids(vocab, 6, 8), _ids(vocab, 25, 9), _ids(vocab, 5, 10)
    with torch.inference_mode():
        built = model(input_ids=torch.tensor([prefix + chunk]), use_cache=True).past_key_values
    n = len(prefix) + len(chunk)
    in_memory = prefill_and_decode(model, tok, built, n, query, max_new_tokens=12)
    spec = RopeSpec.from_config(model.config)
    ctx = assemble_context(
        _prefix_kv(model, prefix),
        [KvSlice(_encode_chunk(model, prefix, chunk), len(prefix), n)],
        spec,
    )
    assembled = prefill_and_decode(
        model, tok, to_dynamic_cache(ctx, model.config), n, query, max_new_tokens=12
    )
    assert assembled.token_ids == in_memory.token_ids
