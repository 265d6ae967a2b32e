"""inference/constrained.py: the one constrained-decoding driver makes the choices of the drivers
it replaced, token for token (greedy: the extractor's jump-forward loop and ``model.generate``;
sampled: the question generator's skeleton loop, per seed), on a tiny random-weight Llama."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from store_fixtures import TINY_DIMS

from inference.constrained import (
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
# they existed; the equality tests above them compared the drivers directly).
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


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(smollm2_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inference.models import LoadedModel

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        **TINY_DIMS,
        max_position_embeddings=2048,
        initializer_range=0.2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    return LoadedModel(model, smollm2_tokenizer, Path("random-llama"), "model-x", "tok-x")


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6], [7]], 0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]


def _extractor_run(loaded, batch: list[str]) -> tuple[Any, list[list[int]], list[Recording], int]:
    from tasks.extractors.local import LocalConstrainedExtractor

    ex = LocalConstrainedExtractor(loaded, min_words=2, max_words=8, max_nuggets=3)
    machines = [Recording(ex.machine(t)) for t in batch]
    prompts = [ex.prompt_ids(t) for t in batch]
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else machines[0].special.eos
    return ex, prompts, machines, pad


def _result(machines: list[Recording]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    return [(m.tokens, list(m.spans)) for m in machines]


@pytest.mark.parametrize("batch", [PASSAGES, PASSAGES[:1]])
def test_greedy_equals_the_old_drivers(loaded, batch) -> None:
    from tasks.extractors.local import run_generate, run_jump_forward

    ex, prompts, old_jump, pad = _extractor_run(loaded, batch)
    run_jump_forward(loaded.model, prompts, old_jump, pad, prefix=ex._prompt_prefix())
    *_, old_generate, _ = _extractor_run(loaded, batch)
    run_generate(loaded.model, prompts, old_generate, pad)
    assert _result(old_jump) == _result(old_generate)

    *_, new_jump, _ = _extractor_run(loaded, batch)
    decode_constrained(
        loaded.model, prompts, new_jump, GreedyChoice(), pad, prefix=ex._prompt_prefix()
    )
    *_, one_by_one, _ = _extractor_run(loaded, batch)
    decode_constrained(loaded.model, prompts, one_by_one, GreedyChoice(), pad, jump_forward=False)
    *_, new_generate, _ = _extractor_run(loaded, batch)
    eos = new_generate[0].special.eos
    decode_with_generate(loaded.model, prompts, new_generate, pad, eos)
    for got in (new_jump, one_by_one, new_generate):
        assert _result(got) == _result(old_jump)
    assert all(m.spans for m in new_jump)
    assert _digest(_result(new_jump)) == GREEDY_DIGEST[len(batch)]


def _skeleton_run(loaded, seed: int):
    from training.selfstudy import (
        LocalQuestionGenerator,
        QuestionRequest,
        SkeletonMachine,
        skeleton_vocab,
    )

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
def test_sampled_equals_the_skeleton_loop(loaded, seed: int) -> None:
    from training.selfstudy import run_skeleton

    gen, prompts, old, gens, sv = _skeleton_run(loaded, seed)
    old_closed: list[int] = []
    run_skeleton(
        loaded.model, prompts, old, gens, temperature=gen.temperature, top_k=gen.top_k,
        repetition_penalty=gen.repetition_penalty, close_boost=gen.close_boost, pad_id=sv.eos,
        on_question=lambda: old_closed.append(1),
    )  # fmt: skip
    gen, prompts, new, gens, sv = _skeleton_run(loaded, seed)
    choice = SampledChoice(
        gen.temperature, gen.top_k, gens, gen.repetition_penalty, bonus=gen.close_boost
    )
    decode_constrained(loaded.model, prompts, new, choice, sv.eos, jump_forward=False)
    assert [m.generated for m in new] == [m.generated for m in old]
    assert all(m.done and m.questions == 3 for m in new)
    assert len(old_closed) == 9
    assert _digest([m.generated for m in new]) == SAMPLED_DIGEST[seed]
