"""inference/model/constrained.py: the one constrained-decoding driver makes the choices of the
drivers it replaced, token for token (greedy: the extractor's jump-forward loop and
``model.generate``; sampled: the question generator's skeleton loop, per seed), on a tiny
random-weight Llama.

The replaced drivers were compared directly while they existed (commit "A6" of issue 14); the
digests below are the tokens they chose then. Greedy decoding is also checked against
``model.generate`` (``decode_with_generate``) and against one-token-per-step feeding."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from store_fixtures import tiny_llama

from coinrag.inference.model.constrained import (
    GreedyChoice,
    SampledChoice,
    decode_constrained,
    decode_with_generate,
    left_pad,
)

PASSAGES = [
    "Gabriel García Márquez (6 March 1927 – 17 April 2014) was a Colombian novelist, "
    "short-story writer, screenwriter, and journalist. He won the 1982 Nobel Prize in Literature.",
    "The Eiffel Tower is 330 m (1,083 ft) tall; it was the tallest man-made structure in the "
    "world until 1930.",
    "One two three four five.",
]
DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, named after Gustave Eiffel.",
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas of Nepal. It "
    "was first climbed in 1953.",
    "The Nile is a river.",
]


# Digests of the tokens the replaced drivers chose on this module's tiny Llama (recorded while
# they existed, next to tests that compared them with this driver directly).
GREEDY_DIGEST = {3: "401a01aa3924c3c8", 1: "b73584d7cdb9bec7"}  # by batch size
SAMPLED_DIGEST = [  # by seed
    "87752599613b4f57",
    "76b062bbbc872883",
    "0288924d556d9c7b",
    "6ddfae8dc8195dc9",
    "1fb57e10536ba1a8",
]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


class Recording:
    """A constraint that records the tokens it takes (until done)."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine
        self.tokens: list[int] = []

    def advance(self, token: int) -> None:
        if not self.machine.done:
            self.tokens.append(int(token))
        self.machine.advance(token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.machine, name)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(smollm2_tokenizer):
    from coinrag.inference.model.loading import LoadedModel

    model = tiny_llama(smollm2_tokenizer, 0, max_position_embeddings=2048, initializer_range=0.2)
    return LoadedModel(model, smollm2_tokenizer, Path("random-llama"), "model-x", "tok-x")


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6], [7]], 0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]


def _extractor_run(loaded, batch: list[str]) -> tuple[Any, list[list[int]], list[Recording], int]:
    from coinrag.tasks.extractors.local import LocalConstrainedExtractor, SpanRules

    ex = LocalConstrainedExtractor(loaded, max_nuggets=3, spans=SpanRules(min_words=2, max_words=8))
    machines = [Recording(ex.machine(t)) for t in batch]
    prompts = [ex.prompt_ids(t) for t in batch]
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else machines[0].special.eos
    return ex, prompts, machines, pad


def _result(machines: list[Recording]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    return [(m.tokens, list(m.spans)) for m in machines]


@pytest.mark.parametrize("batch", [PASSAGES, PASSAGES[:1]])
def test_greedy_makes_the_old_choices(loaded, batch) -> None:
    ex, prompts, jump, pad = _extractor_run(loaded, batch)
    decode_constrained(loaded.model, prompts, jump, GreedyChoice(), pad, prefix=ex._prompt_prefix())
    *_, one_by_one, _ = _extractor_run(loaded, batch)
    decode_constrained(loaded.model, prompts, one_by_one, GreedyChoice(), pad, jump_forward=False)
    *_, generate, _ = _extractor_run(loaded, batch)
    decode_with_generate(loaded.model, prompts, generate, pad, generate[0].special.eos)
    for got in (one_by_one, generate):
        assert _result(got) == _result(jump)
    assert all(m.spans for m in jump)
    assert _digest(_result(jump)) == GREEDY_DIGEST[len(batch)]


def _skeleton_run(loaded, seed: int):
    from coinrag.tasks.question_generators.base import QuestionRequest
    from coinrag.tasks.question_generators.local import LocalQuestionGenerator
    from coinrag.tasks.question_generators.skeleton import SkeletonMachine, skeleton_vocab

    gen = LocalQuestionGenerator(
        loaded, n_questions=3, min_question_tokens=2, max_question_tokens=6
    )
    reqs = [QuestionRequest(f"k{i}", t, "question", 0) for i, t in enumerate(DOCS)]
    prompts = [gen.prompt_ids(r) for r in reqs]
    sv = skeleton_vocab(loaded.tokenizer)
    machines = [SkeletonMachine(sv, 3, 2, 6) for _ in reqs]
    gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(reqs))]
    return gen, prompts, machines, gens, sv


@pytest.mark.parametrize("seed", range(5))
def test_sampled_makes_the_old_choices(loaded, seed: int) -> None:
    gen, prompts, machines, gens, sv = _skeleton_run(loaded, seed)
    s = gen.sampling
    choice = SampledChoice(s.temperature, s.top_k, gens, s.repetition_penalty, bonus=s.close_boost)
    advanced: list[int] = []
    decode_constrained(
        loaded.model, prompts, machines, choice, sv.eos, jump_forward=False,
        on_advance=advanced.append,
    )  # fmt: skip
    assert all(m.done and m.questions == 3 for m in machines)
    steps = max(len(m.generated) - 1 for m in machines)  # tokens taken (generated ends in EOS)
    assert advanced == list(range(len(machines))) * steps  # every row, once per step
    assert _digest([m.generated for m in machines]) == SAMPLED_DIGEST[seed]
