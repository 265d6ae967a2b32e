"""What a KV store's key basis is calibrated on (``storage/kv/basis.py``): the model's keys
before RoPE and the size of the queries that read them, on a few of the store's chunks.

Each calibration text is encoded after the prompt prefix, as the KV stage encodes a chunk
(:func:`encode.document_kv`), its keys rotated back to position 0 (the frame a quantized store
codes); the queries are read in the same forward from the module whose output is the query
before RoPE: ``q_norm`` where the attention has one (Qwen3 and Gemma 3: per head, after the
projection; OLMo 2: over the whole projection), else ``q_proj``. A model whose attention has
neither (GPT-NeoX's and Phi-3's fused projections) gets weights of 1: the basis is then the
keys' principal axes alone, still exact to invert, only less tuned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coinrag.inference.model.encode import decoder, document_kv, keys_to_position_zero
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import model_rope, reset_rotary
from coinrag.storage.kv.basis import KeyBasis, calibrated_basis


@dataclass(frozen=True)
class KeyStatistics:
    """``query_rms`` ``(L, H, D)`` float32: per layer, key-value head and channel, the RMS
    over the texts' tokens and the query heads of the group of the query's pair energy
    ``q_c² + q_c'²`` (``c'`` the channel RoPE turns with ``c``: ``c ± D / 2``); ``keys``: each
    text's keys before RoPE ``(L, H, T_i, D)`` float32 (on the CPU, whatever the model's
    device); ``queries_from``: the module read
    (``q_norm``, ``q_proj`` or ``none``)."""

    query_rms: torch.Tensor
    keys: list[torch.Tensor]
    queries_from: str


def query_modules(model: Any) -> tuple[str, list[Any]]:
    """Per decoder layer the module whose output is the query before RoPE, and its name;
    ``("none", [])`` where the layers have no ``self_attn.q_norm`` or ``q_proj``."""
    layers = getattr(decoder(model), "layers", None) or []
    for name in ("q_norm", "q_proj"):
        found = [getattr(getattr(layer, "self_attn", None), name, None) for layer in layers]
        if found and all(isinstance(m, torch.nn.Module) for m in found):
            return name, found
    return "none", []


def key_statistics(model: Any, prompt: RagPrompt, texts: Sequence[Sequence[int]]) -> KeyStatistics:
    """:class:`KeyStatistics` of ``texts`` (token ids; each encoded after ``prompt``'s prefix
    in a forward of its own)."""
    if not texts:
        raise ValueError("calibration needs at least one text")
    config = model.config.get_text_config(decoder=True)
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q  # GPT-NeoX: no GQA
    dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    source, modules = query_modules(model)
    sums = torch.zeros(config.num_hidden_layers, n_kv, dim, dtype=torch.float64)
    count = 0
    p = prompt.n_prefix
    length = [0]  # tokens of the forward running: prefix and text

    def hook(index: int) -> Any:
        def record(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
            q = out.float()
            if q.dim() == 4 and q.shape[1] != length[0]:  # (B, heads, T, D): Gemma 3's q_norm
                q = q.transpose(1, 2)
            q = q[:, p:].reshape(-1, n_kv, n_q // n_kv, dim)  # (T, H, group, D)
            pair = q.square() + torch.roll(q, dim // 2, -1).square()
            sums[index] += pair.sum((0, 2)).double().cpu()

        return record

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    spec = model_rope(model.config)
    keys = []
    try:
        for ids in texts:
            length[0] = p + len(ids)
            kv = document_kv(model, prompt, ids)
            keys.append(keys_to_position_zero(kv, spec, p)[:, 0].cpu().contiguous())
            count += len(ids) * (n_q // n_kv)
    finally:
        for handle in handles:
            handle.remove()
        reset_rotary(model)
    if source == "none":
        return KeyStatistics(torch.ones_like(sums, dtype=torch.float32), keys, source)
    return KeyStatistics((sums / max(1, count)).sqrt().float(), keys, source)


def calibrated_key_basis(
    model: Any, prompt: RagPrompt, texts: Sequence[Sequence[int]]
) -> tuple[KeyBasis, str]:
    """The key basis (``storage.kv.basis.calibrated_basis``) of :func:`key_statistics` of
    ``texts``, and the module the queries were read from."""
    stats = key_statistics(model, prompt, texts)
    return calibrated_basis(stats.query_rms, stats.keys), stats.queries_from
