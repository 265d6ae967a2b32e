"""Golden fingerprints: what moving code must never change.

Every asset is keyed by fingerprints of its producer (extractor, question generator, teacher,
cartridge training), and a resumed fine-tuning run compares ``identity()`` dicts. The literals
below were recorded on the code before the issue-14 refactor; a refactor changes only this
file's imports. A value that changes on purpose (a prompt edit, a new setting) is a new literal
and a note in the commit: every store re-computes the assets keyed by it.
"""

from __future__ import annotations

from types import SimpleNamespace

from coinrag.inference.llm.client import LlmEndpoint
from coinrag.schemas.settings import (
    BuildSettings,
    CartridgeSettings,
    CartridgeTrainSettings,
    FinetuneSettings,
    TeacherSettings,
)
from coinrag.tasks.extractors.local import DECODING, LOCAL_PROMPT_VERSION, LocalConstrainedExtractor
from coinrag.tasks.extractors.none import NoExtractor
from coinrag.tasks.extractors.openai_batch import OpenAIBatchExtractor
from coinrag.tasks.extractors.openai_chat import OpenAIChatExtractor
from coinrag.tasks.extractors.prompt import PROMPT_VERSION
from coinrag.tasks.extractors.rules import RulesExtractor
from coinrag.tasks.question_generators.accept import ACCEPTS_VERSION
from coinrag.tasks.question_generators.local import LocalQuestionGenerator
from coinrag.tasks.question_generators.openai_chat import OpenAIQuestionGenerator
from coinrag.tasks.question_generators.prompt import PROMPT_VERSION as QUESTION_PROMPT_VERSION
from coinrag.tasks.teacher import teacher_fingerprint
from coinrag.training.cartridges import CartridgeSpec, cartridge_fingerprint

KEY = "sk-frozen-test"  # a client needs a key; none reaches a fingerprint
LOADED = SimpleNamespace(model_fp="model-x")  # a LoadedModel as far as fingerprints look


def test_prompt_and_decoding_versions() -> None:
    assert PROMPT_VERSION == "p-de53bb579e29"
    assert LOCAL_PROMPT_VERSION == "pl-1fcc2c2454bb"
    assert QUESTION_PROMPT_VERSION == "qp-70b59b2cccd8"
    assert DECODING == "greedy-constrained-v2"
    assert ACCEPTS_VERSION == "questions-v2"


def test_extractor_fingerprints() -> None:
    mini = LlmEndpoint("gpt-4o-mini", api_key=KEY)
    assert OpenAIChatExtractor(mini).fingerprint == "extractor-a5561ee6f2a11392"
    chat = OpenAIChatExtractor(LlmEndpoint("gpt-4o", api_key=KEY), structured=True)
    assert chat.fingerprint == "extractor-4114a0e57b25e2a1"
    assert OpenAIBatchExtractor(mini).fingerprint == "extractor-72eac671c3597234"
    assert LocalConstrainedExtractor(LOADED).fingerprint == "extractor-21d508d94930afb2"
    assert RulesExtractor().fingerprint == "extractor-a626735d28c67d36"
    assert NoExtractor().fingerprint == "extractor-1e390ed27f6b2020"


def test_question_generator_fingerprints() -> None:
    mini = LlmEndpoint("gpt-4o-mini", api_key=KEY)
    assert OpenAIQuestionGenerator(mini).fingerprint == "qgen-a91fe0d407af4a2e"
    assert LocalQuestionGenerator(LOADED).fingerprint == "qgen-53a499605207f07a"


def test_teacher_and_cartridge_fingerprints() -> None:
    settings = CartridgeSettings()
    assert teacher_fingerprint("m", "p", TeacherSettings()) == "teacher-ac41f481a100c307"
    assert teacher_fingerprint("m", "p", settings.teacher()) == "teacher-ac41f481a100c307"
    assert settings.teacher().value_dict() == {
        "max_new_tokens": 48,
        "top_k": 20,
        "max_doc_tokens": 2048,
        "decoding": "greedy-v1",
    }
    plain = cartridge_fingerprint(
        "m", "p", "t", CartridgeSpec(), CartridgeTrainSettings().value_dict()
    )
    assert plain == "cartridge-449c99d9ee581eea"
    spec = CartridgeSpec.from_settings(settings)
    fp = cartridge_fingerprint("m", "p", "t", spec, settings.train().value_dict())
    assert fp == "cartridge-d91c50cf33c7b10e"
    assert spec.to_dict() == {
        "p": None,
        "ratio": 4.0,
        "init": "first_tokens",
        "freeze_first": True,
        "min_p": 2,
    }
    assert settings.train().value_dict() == {
        "lr": 0.02,
        "visibility": {"p_iso": 0.5, "k_min": 1, "k_max": 3},
        "budget": 8,
        "rotate_every": 16,
        "batch_size": 1,
        "train_distractors": True,
        "seed": 0,
        "betas": [0.9, 0.999],
        "eps": 1e-08,
    }


CARTRIDGE_SETTINGS = {
    "model": None,
    "device": "cpu",
    "generator": None,
    "llm_model": "gpt-4o-mini",
    "base_url": None,
    "n_questions": 20,
    "n_calls": None,
    "chars_per_call": 2000,
    "seed": 0,
    "local_batch_size": 32,
    "local_dtype": "auto",
    "max_new_tokens": 48,
    "top_k": 20,
    "max_doc_tokens": 2048,
    "teacher_batch_size": 8,
    "p": None,
    "ratio": 4.0,
    "init": "first_tokens",
    "freeze_first": True,
    "lr": 0.02,
    "p_iso": 0.5,
    "k_min": 1,
    "k_max": 3,
    "budget": 8,
    "rotate_every": 16,
    "batch_size": 1,
    "train_distractors": True,
    "checkpoint_every": 50,
}

FINETUNE_IDENTITY = {
    "mode": "live",
    "lora": False,
    "epochs": 1,
    "lr": 5e-06,
    "batch_size": 16,
    "max_length": 1024,
    "kc": 5,
    "k": 10,
    "raft_p": 0.15,
    "seed": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_ratio": 0.03,
    "schedule": "linear",
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "max_steps": None,
    "device": "cpu",
    "dtype": None,
}

BUILD_SETTINGS = {
    "extractor": None,
    "llm_model": "gpt-4o-mini",
    "model": "smollm2",
    "html_mode": "main",  # how a folder's files are read (issue 32)
    "exclude": "",
    "max_file_bytes": 200 * 2**20,
    "chunker": "fixed",
    "chunk_size": 512,
    "tau": 0.7,
    "concurrency": 8,
    "max_attempts": 5,
    "abandon_after": 3,  # malformed builds before a chunk text is abandoned (issue 22)
    "retry_abandoned": False,
    "request_timeout": 60.0,
    "batch_poll_interval": 30.0,
    "batch_max_rounds": 3,
    "local_max_nuggets": 8,
    "extract_batch_size": 32,
    "device": "cpu",
    "embedder": "minilm",
    "embed_dtype": "float32",
    "embed_window": 0,  # word pieces per embedded window (0: the embedder's own; issue 35)
    "kv": True,
    "kv_dtype": "auto",
    "kv_codec": "none",
    "kv_keep": "chunks",
    "kv_batch_size": 4,
    "kv_fill_device": True,  # how large a GPU's KV batches are (never what is stored; issue 37)
    "retrieval": "hybrid",  # how queries rank (issue 21): never part of a build fingerprint
    "rerank": "none",  # how queries reorder the top chunks (issue 35): never fingerprinted
    "index": True,
    "prune": False,
    "embed_batch_size": 4096,
    "runner": "default",
    "runner_address": "",
    "workers": 2,
    "kv_resources": "",
    "kv_verify": "crc32c",
    "kv_space_check": True,
    "kv_min_free_bytes": 0,
    "threads": 0,  # how many threads the build computes with (never what it builds)
}


def test_settings_dicts() -> None:
    """Recorded in runs.parameters_json and STORE/coinrag.toml (names and order)."""
    for got, want in (
        (CartridgeSettings().to_dict(), CARTRIDGE_SETTINGS),
        (BuildSettings().to_dict(), BUILD_SETTINGS),
    ):
        assert got == want
        assert list(got) == list(want)


def test_finetune_resume_identity() -> None:
    """A run resumes a checkpoint only when its identity equals the checkpoint's."""
    identity = FinetuneSettings().identity()
    assert identity == FINETUNE_IDENTITY
    assert list(identity) == list(FINETUNE_IDENTITY)
