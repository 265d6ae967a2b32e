"""Helpers shared by the incremental-build, deletion, gc and crash tests: small real models
saved to folders (so builds load them exactly as users' models) and JSONL corpora; and where a
reST page's headings start (the section chunker's tests and benchmark)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# The shape of every small random-weight model the tests build (2 layers, 4 query heads sharing
# 2 KV heads; head dim 16 unless a test sets head_dim): each test adds its architecture,
# vocabulary and RoPE settings.
TINY_DIMS: dict[str, int] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


# The three verified architectures as tiny random-weight configs (vocabulary 500): Qwen2 with
# default RoPE, Llama with llama3 RoPE, Qwen3 with default RoPE and q/k norms.
TINY_ARCHITECTURES = ("qwen2", "llama3", "qwen3")
# Llama 3.x's RoPE scaling as the tiny configs use it (original context 512, so the scaling
# applies within the lengths the tests reach).
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A TINY_DIMS config of ``arch`` (one of TINY_ARCHITECTURES); ``overrides`` replace its
    arguments (e.g. ``num_hidden_layers=4``, ``attn_implementation="eager"``)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base: dict[str, Any] = dict(TINY_DIMS, vocab_size=500, max_position_embeddings=4096)
    default_rope = {"rope_type": "default", "rope_theta": 1e6}
    if arch == "qwen2":
        return Qwen2Config(**{**base, "rope_parameters": default_rope, **overrides})
    if arch == "llama3":
        return LlamaConfig(**{**base, "rope_parameters": dict(LLAMA3_ROPE), **overrides})
    if arch == "qwen3":
        return Qwen3Config(**{**base, "head_dim": 16, "rope_parameters": default_rope, **overrides})
    raise ValueError(f"unknown tiny architecture {arch!r}")


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight float32 model of :func:`tiny_config` in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def random_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    """``n`` token ids in ``[3, vocab)``, reproducible by ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def tiny_llama(tokenizer: Any, seed: int, **config: Any) -> Any:
    """A random-weight 2-layer Llama (TINY_DIMS) for ``tokenizer``'s vocabulary, in memory, in
    eval mode; ``config`` overrides LlamaConfig arguments (e.g. ``initializer_range``)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **{
            "vocab_size": len(tokenizer),
            **TINY_DIMS,
            "max_position_embeddings": 4096,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            **config,
        }
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def save_tiny_llama(path: Path, tokenizer: Any, seed: int, **config: Any) -> Path:
    """A random-weight 2-layer Llama with ``tokenizer`` (SmolLM2's), saved as a model folder.

    Two seeds give two generation models with one tokenizer: another ``model_fp``, the same
    ``tokenizer_fp`` (so the same chunks and content keys). ``config`` overrides LlamaConfig
    arguments (e.g. ``rope_parameters``, ``max_position_embeddings``).
    """
    model = tiny_llama(tokenizer, seed, **config)
    path.mkdir(parents=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_script(path: Path) -> ModuleType:
    """A script of ``infra/`` (not a package: nothing imports it) loaded as a module by path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_docs(sample_corpus: Path, n: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` records of the bundled sample corpus (all if None)."""
    lines = sample_corpus.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:n] if line.strip()]


RST_ADORNMENT = set("=-~^\"'`*+#:.<>_")  # the characters of a reST title's underline


def rst_heading_starts(text: str) -> tuple[int, ...]:
    """Char offsets where the section titles of a reST page start, as a reader's heading map
    gives them: the title's line, or its overline. A title is an unindented line underlined by
    a run of one adornment character at least as long (as ``infra/python_faq.py`` finds them).

    >>> rst_heading_starts("Intro\\n=====\\n\\ntext\\n\\n====\\nPage\\n====\\n")
    (0, 19)
    """

    def adornment(line: str, title: str) -> bool:
        s = line.rstrip()
        return len(set(s)) == 1 and s[0] in RST_ADORNMENT and len(s) >= len(title.rstrip())

    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    out = []
    for i in range(len(lines) - 1):
        title = lines[i]
        if title.strip() and not title[0].isspace() and not adornment(title, title):
            if adornment(lines[i + 1], title):
                overlined = i > 0 and adornment(lines[i - 1], title)
                out.append(starts[i - 1] if overlined else starts[i])
    return tuple(out)


def write_corpus(path: Path, docs: list[dict[str, Any]]) -> Path:
    """Write records as a JSONL source; return its path."""
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


def synthetic_chunk(i: int, n: int) -> Any:
    """A chunk row of ``n`` tokens with no text (KV store tests: only ids and sizes matter)."""
    from coinrag.schemas.tables import ChunkRow

    return ChunkRow(
        chunk_id=f"ch-{i}",
        doc_id="d",
        doc_version="dv",
        ordinal=i,
        text="",
        n_tokens=n,
        char_start=0,
        char_end=0,
        tok_start=0,
        tok_end=n,
        token_ids=[],
        token_spans=[],
        content_key=f"ck-{i:04d}",
        text_hash="th",
        tokenizer_fp="tok",
        chunker_fp="chunker",
        run_id="r",
        code_version="v",
    )


def nugget_spans(
    content_keys: list[str], k: int = 10, length: int = 12, tokens: int = 512, seed: int = 0
) -> list[tuple[str, int, int]]:
    """``k`` nugget-like slices ``(content_key, start, end)`` of ``length`` tokens, two per
    entry (as coinrag's k = 10 nuggets among kc = 5 chunks), apart from each other, at seeded
    random places of entries of ``tokens`` tokens."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(k):
        ck = content_keys[(i // 2) % len(content_keys)]
        half = tokens // 2  # the first of a pair in the first half, the second in the second
        start = (i % 2) * half + rng.randrange(0, half - length)
        out.append((ck, start, start + length))
    return out


def held_and_retriever_pages(n_held: int, n_retriever: int) -> tuple[list[str], list[str]]:
    """Page ids (``page-<i>``) of ``n_held`` held-out (fusion or report) and ``n_retriever``
    retriever pages: ``tasks.retrieval.fusion.page_split`` splits pages by a hash of their id."""
    from coinrag.tasks.retrieval.fusion import page_split

    held, trained, i = [], [], 0
    while len(held) < n_held or len(trained) < n_retriever:
        name = f"page-{i}"
        (trained if page_split(name) == "retriever" else held).append(name)
        i += 1
    return held[:n_held], trained[:n_retriever]
