"""Every plug-in kind is one registry by subclass name (``schemas/registry.py``): each lists its
subclasses under the names the settings declare, and refuses an unknown name with the known ones."""

from __future__ import annotations

import pytest

from coinrag.flows.scaleout import Runner
from coinrag.inference.methods.base import RagMethod
from coinrag.inference.retrieval.retriever import SearchMode
from coinrag.inference.rope.frequencies import ROPE_TYPES, DynamicRope, LongRope, RopeType
from coinrag.schemas.registry import Registered, Registry, UnknownPlugin
from coinrag.schemas.settings import (
    CHUNKERS,
    EXTRACTORS,
    KV_CODECS,
    QUESTION_GENERATORS,
    RAG_METHODS,
    RETRIEVAL_MODES,
    RUNNERS,
)
from coinrag.storage.kv.codecs import Int4Codec, Int8Codec, KvCodec
from coinrag.tasks.chunk import Chunker, ContentChunker, FixedChunker, SentenceChunker
from coinrag.tasks.chunk_section import SectionChunker
from coinrag.tasks.extractors.base import Extractor
from coinrag.tasks.question_generators.base import QuestionGenerator

KINDS = [
    (Extractor, EXTRACTORS, "extractor"),
    (QuestionGenerator, QUESTION_GENERATORS, "question generator"),
    (KvCodec, KV_CODECS, "KV codec"),
    (Chunker, CHUNKERS, "chunker"),
    (RopeType, ROPE_TYPES, "rope type"),
    (Runner, RUNNERS, "runner"),
    (RagMethod, RAG_METHODS, "RAG method"),
    (SearchMode, RETRIEVAL_MODES, "retrieval mode"),
]


@pytest.mark.parametrize(("base", "names", "kind"), KINDS, ids=[k for *_, k in KINDS])
def test_registry_lists_its_subclasses_under_the_declared_names(base, names, kind) -> None:
    registry = base.registry
    assert sorted(registry) == sorted(names)
    for name in names:
        cls = registry[name]
        assert issubclass(cls, base) and cls.name == name
    if base is Extractor or base is QuestionGenerator:
        assert all(registry[n].backend == n for n in names)


@pytest.mark.parametrize(("base", "names", "kind"), KINDS, ids=[k for *_, k in KINDS])
def test_registry_refuses_an_unknown_name_listing_the_known(base, names, kind) -> None:
    with pytest.raises(UnknownPlugin) as err:
        base.registry["no-such"]
    assert str(err.value) == f"unknown {kind} 'no-such' ({', '.join(sorted(names))})"
    assert isinstance(err.value, ValueError)  # callers that caught ValueError still do


def test_known_classes() -> None:
    # the build hands the Batch API every pending text at once (one submission)
    assert [n for n in EXTRACTORS if Extractor.registry[n].takes_all_at_once] == ["openai-batch"]
    assert (KvCodec.registry["int8"], KvCodec.registry["int4"]) == (Int8Codec, Int4Codec)
    chunkers = FixedChunker.registry
    assert [chunkers[n] for n in ("fixed", "sentence", "content", "section")] == [
        FixedChunker,
        SentenceChunker,
        ContentChunker,
        SectionChunker,
    ]


def test_rope_types_say_which_depend_on_the_forward_length() -> None:
    dependent = {n for n in ROPE_TYPES if RopeType.registry[n].seq_len_dependent}
    assert dependent == {"dynamic", "longrope"}
    # any name containing "dynamic" behaves as dynamic NTK (as transformers tests it); an
    # unregistered name as a type whose frequencies never change
    assert RopeType.of("dynamic") is DynamicRope and RopeType.of("longrope") is LongRope
    assert RopeType.of("mrope") is RopeType and RopeType.of("default").threshold(None, {}) is None


def test_subclassing_registers_and_a_second_class_of_a_name_is_refused() -> None:
    class Kind(Registered):
        registry = Registry("probe", ("a",), modules={})

    class A(Kind, name="a"):
        pass

    class B(Kind, name="b"):  # not declared: listed after the declared names
        pass

    assert Kind.registry.known() == ["a", "b"]
    assert dict(Kind.registry) == {"a": A, "b": B}
    assert "a" in Kind.registry and "c" not in Kind.registry
    with pytest.raises(ValueError, match="two probes named 'a'"):

        class Other(Kind, name="a"):
            pass


def test_a_plugin_module_is_imported_on_first_look_up_only() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from coinrag.tasks.extractors.base import Extractor\n"
        "mod = 'coinrag.tasks.extractors.openai_batch'\n"
        "assert mod not in sys.modules and 'openai-batch' in Extractor.registry\n"
        "cls = Extractor.registry['openai-batch']\n"
        "assert mod in sys.modules and cls.__module__ == mod\n"
    )
    methods = (  # a RAG method's module too: `query --method standard` never imports cartridge
        "import sys\n"
        "from coinrag.inference.methods import METHODS\n"
        "mod = 'coinrag.inference.methods.cartridge'\n"
        "assert METHODS['standard'].name == 'standard' and mod not in sys.modules\n"
        "assert 'cartridge' in METHODS and mod not in sys.modules\n"
        "assert METHODS['coinrag-onestage'].__module__.endswith('coinrag_ablations')\n"
    )
    subprocess.run([sys.executable, "-c", code + methods], check=True)


def test_each_plugin_is_built_from_its_settings(monkeypatch, tmp_path) -> None:
    from coinrag.schemas.settings import BuildSettings, CartridgeSettings
    from coinrag.tasks.extractors.factory import make_extractor
    from coinrag.tasks.question_generators.factory import make_generator

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-plugin")
    settings = BuildSettings(
        extractor="openai-batch", llm_model="gpt-4o", max_attempts=2, batch_max_rounds=4
    )
    batch = make_extractor(settings, str(tmp_path))
    assert (batch.backend, batch.llm_model, batch.max_rounds) == ("openai-batch", "gpt-4o", 4)
    assert batch.endpoint.retry.max_attempts == 2
    assert batch.state_path == tmp_path / "openai-batch-state.json"
    chat = Extractor.registry["openai"].from_settings(
        BuildSettings(extractor="openai", concurrency=3, request_timeout=7.0)
    )
    assert (chat.concurrency, chat.endpoint.client.timeout) == (3, 7.0)
    assert Extractor.registry["rules"].from_settings(settings).backend == "rules"

    chunker = Chunker.from_settings(BuildSettings(chunker="sentence", chunk_size=64))
    assert type(chunker) is SentenceChunker and chunker.chunk_size == 64

    gen = make_generator(CartridgeSettings(generator="openai", n_questions=3), None)
    assert (gen.backend, gen.n_questions) == ("openai", 3)
