"""Model families where users meet them: ``coinrag build --model DIR`` with a tiny random model
of each family saved as a Hugging Face folder (SmolLM2's tokenizer), then turborag ``--kc 1``
and standard ``--kc 1`` on the store; and what is not exact refused by the preflight, before
any work, as one ``error:`` line naming the model type and the feature (exit 2).

Every family's build is in the heavy tier (``-m heavy``, run by CI), one build each; the
refusals run in the default tier.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from model_families import FAMILIES, family_config
from store_fixtures import sample_docs, write_corpus
from test_cli_errors import SERVER_STARTED, assert_error_line, coinrag
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPTJConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen2VLConfig,
    SmolLM3Config,
)

from coinrag.inference.model.loading import locate_model
from coinrag.inference.model.support import (
    UnsupportedModel,
    check_config,
    check_model_reference,
    gguf_architecture,
)

LOGIT_ATOL_FP32 = 2e-4
QUESTION = "Who directed 2001: A Space Odyssey?"


def _save(path: Path, config, tokenizer) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _build_and_compare(tmp_path: Path, family: str, tokenizer, sample_corpus: Path) -> None:
    from coinrag.inference.methods import RagEngine

    model_dir = _save(tmp_path / family, family_config(family, tokenizer=tokenizer), tokenizer)
    source = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 2))
    store = tmp_path / "store"
    built = coinrag(
        "build", str(source), "--store", str(store), "--model", str(model_dir),
        "--kv-dtype", "float32", "--extractor", "rules", "--chunk-size", "64",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    engine = RagEngine.open(str(store), max_new_tokens=8, methods=["turborag", "standard"])
    first: list[torch.Tensor] = []  # the query prefill's logits (first call of an answer)
    hook = engine.model.lm_head.register_forward_hook(
        lambda m, a, out: first.append(out[0, -1].float()) if not first else None
    )
    try:
        answers = {}
        for method in ("turborag", "standard"):
            first.clear()
            answers[method] = (engine.answer(QUESTION, method, kc=1), first[0])
    finally:
        hook.remove()
        engine.close()
    (turbo, turbo_logits), (standard, standard_logits) = answers.values()
    assert turbo.evidence == standard.evidence and turbo.active_tokens > 0
    assert turbo.token_ids == standard.token_ids
    assert float((turbo_logits - standard_logits).abs().max()) <= LOGIT_ATOL_FP32


@pytest.mark.heavy  # 43-67 s on a loaded machine: the default tier stays under 15 minutes
def test_gemma3_store_builds_and_turborag_kc1_equals_standard(
    tmp_path: Path, smollm2_tokenizer, sample_corpus: Path
) -> None:
    _build_and_compare(tmp_path, "gemma3", smollm2_tokenizer, sample_corpus)


@pytest.mark.heavy
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])
def test_family_store_builds_and_turborag_kc1_equals_standard(
    tmp_path: Path, family: str, smollm2_tokenizer, sample_corpus: Path
) -> None:
    _build_and_compare(tmp_path, family, smollm2_tokenizer, sample_corpus)


# ---------------------------------------------------------------------------- refused


_BASE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=500)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8), ["gptj", "GPT-J"]),
        (lambda: SmolLM3Config(**_BASE), ["smollm3", "NoPE"]),
        (lambda: Qwen2VLConfig(), ["qwen2_vl", "M-RoPE"]),
        (lambda: Gemma3TextConfig(**_BASE, use_bidirectional_attention=True), ["bidirectional"]),
        (
            lambda: Gemma3TextConfig(
                **_BASE,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            ),
            ["gemma3_text", "'dynamic'", "per-layer"],
        ),
        (
            lambda: LlamaConfig(**_BASE, rope_parameters={"rope_type": "ntk", "rope_theta": 1e4}),
            ["llama", "rope type 'ntk'"],
        ),
        (
            lambda: Qwen2Config(
                **_BASE, rope_parameters={"full_attention": {"rope_type": "default"}}
            ),
            ["qwen2", "per-layer"],
        ),
    ],
    ids=["gptj", "smollm3", "qwen2_vl", "gemma3-bidirectional", "gemma3-dynamic", "ntk", "qwen2"],
)
def test_not_exact_is_refused_by_model_type_and_feature(make, words) -> None:
    with pytest.raises(UnsupportedModel) as info:
        check_config(make())
    message = str(info.value)
    assert "\n" not in message and message.startswith("model type ")
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matrix_families_pass_the_check(family: str) -> None:
    check_config(family_config(family))


def test_config_json_alone_decides(tmp_path: Path) -> None:
    """A folder's ``config.json`` is read as JSON first: an unknown or unverified model type is
    refused without transformers parsing it (no weights are ever read)."""
    for text, words in [
        ('{"model_type": "nonsense"}', ["'nonsense'", "not verified"]),
        ('{"model_type": "gemma3"}', ["'gemma3'", "gemma3_text"]),
        ("{not json", ["unreadable"]),
    ]:
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(UnsupportedModel) as info:
            check_model_reference(tmp_path)
        assert all(w in str(info.value) for w in words), str(info.value)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    check_model_reference(tmp_path)


def _gguf_header(path: Path, architecture: str) -> Path:
    """A GGUF file holding only a header: one u32 field, then ``general.architecture``."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    body += string("general.alignment") + struct.pack("<II", 4, 32)
    body += string("general.architecture") + struct.pack("<I", 8) + string(architecture)
    path.write_bytes(body)
    return path


def test_gguf_architecture_read_from_the_header(tmp_path: Path) -> None:
    assert gguf_architecture(locate_model(None)) == "llama"  # the packaged SmolLM2
    check_model_reference(locate_model(None))
    refused = _gguf_header(tmp_path / "m.gguf", "gptj")
    assert gguf_architecture(refused) == "gptj"
    with pytest.raises(UnsupportedModel, match="'gptj'"):
        check_model_reference(refused)
    check_model_reference(_gguf_header(tmp_path / "ok.gguf", "gemma3"))


def test_build_refuses_an_unsupported_model_in_one_line(tmp_path: Path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=len(tok), **ids)
    model_dir = _save(tmp_path / "gptj", config, tok)
    source = write_corpus(tmp_path / "docs.jsonl", [{"id": "a", "text": "Alpha is a letter."}])
    store = tmp_path / "store"
    result = coinrag("build", str(source), "--store", str(store), "--model", str(model_dir))
    assert_error_line(result, 2, "--model", "model type 'gptj'", "interleaved (GPT-J style) RoPE")
    assert SERVER_STARTED not in result.stdout + result.stderr
    assert not store.exists()
