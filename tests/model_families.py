"""The model families of the coverage matrix (docs/model-families.md) as tiny random-weight
configs: hidden 64, 2-3 layers, head dim 16, vocabulary 500 (or a tokenizer's), small sliding
windows (8) so that chunks of a few dozen tokens are longer than the window.

Each family is built with transformers' own config class, with the feature the matrix holds it
for: llama3 scaling (Llama 3.x), sliding layers mixed with full ones (Qwen2 / Qwen2.5 with
``use_sliding_window``), QK-norm (Qwen3, OLMo 2, Gemma 3), all-sliding layers (Mistral),
alternating sliding/full layers with attention and final soft-capping (Gemma 2), dual RoPE
(local base for sliding layers, global base with linear scaling for full ones: Gemma 3),
longrope with partial rotary (Phi-3), partial rotary 1/4 (GPT-NeoX).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from store_fixtures import LLAMA3_ROPE

WINDOW = 8
_DIMS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _llama3(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_DIMS, num_hidden_layers=2, rope_parameters=dict(LLAMA3_ROPE), **kw)


def _qwen2(**kw: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **_DIMS,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,  # layer 0 full, layers 1-2 sliding
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **kw,
    )


def _qwen3(**kw: Any) -> Any:
    from transformers import Qwen3Config

    rope = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen3Config(**_DIMS, num_hidden_layers=2, head_dim=16, rope_parameters=rope, **kw)


def _mistral(**kw: Any) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_DIMS, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, **kw)


def _gemma2(**kw: Any) -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_DIMS,
        num_hidden_layers=3,  # sliding, full, sliding
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **kw,
    )


def _gemma3(**kw: Any) -> Any:
    from transformers import Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    return Gemma3TextConfig(
        **_DIMS,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=rope,
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
        **kw,
    )


def _phi3(**kw: Any) -> Any:
    from transformers import Phi3Config

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
    }
    dims = {**_DIMS, "max_position_embeddings": 4096}
    return Phi3Config(
        **dims,
        num_hidden_layers=2,
        original_max_position_embeddings=1024,
        partial_rotary_factor=0.5,
        rope_parameters=rope,
        **kw,
    )


def _olmo2(**kw: Any) -> Any:
    from transformers import Olmo2Config

    rope = {"rope_type": "default", "rope_theta": 500000.0}
    return Olmo2Config(**_DIMS, num_hidden_layers=2, rope_parameters=rope, **kw)


def _gpt_neox(**kw: Any) -> Any:
    from transformers import GPTNeoXConfig

    dims = {k: v for k, v in _DIMS.items() if k != "num_key_value_heads"}
    return GPTNeoXConfig(**dims, num_hidden_layers=2, rotary_pct=0.25, **kw)


FAMILIES: dict[str, Callable[..., Any]] = {
    "llama3": _llama3,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "gpt_neox": _gpt_neox,
}
# transformers runs Gemma 2 in eager attention only (its SDPA path has no soft-capping).
EAGER_ONLY = {"gemma2"}
ATTENTIONS = ("sdpa", "eager")


def family_cases() -> list[tuple[str, str]]:
    """(family, attention implementation) pairs of the matrix."""
    return [(f, a) for f in FAMILIES for a in ATTENTIONS if a == "eager" or f not in EAGER_ONLY]


def family_config(name: str, vocab: int = 500, tokenizer: Any = None, **kw: Any) -> Any:
    """The family's tiny config (``tokenizer``: its vocabulary and special ids instead)."""
    ids: dict[str, Any] = {"vocab_size": vocab, "pad_token_id": 0, "bos_token_id": 1}
    ids["eos_token_id"] = 2
    if tokenizer is not None:
        ids = {
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
    return FAMILIES[name](**ids, **kw)


def family_model(name: str, attn: str = "sdpa", seed: int = 0, **kw: Any) -> Any:
    """A float32 random-weight model of the family, in eval mode, with ``attn`` attention."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(name, **kw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return model.eval()
