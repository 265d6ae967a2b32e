"""The RAG prompt, cut into the pieces that KV reuse needs.

Every method (``standard``, ``turborag``, ``coinrag``) feeds the model the same token sequence::

    prefix_ids  +  chunk_1 ids  +  ...  +  chunk_k ids  +  query_ids(question)
    \\__ C_p __/    \\___ precomputed (or sliced) chunk KV ___/    \\_ prefilled online _/

- ``prefix_ids``: the chat template rendered up to where the retrieved context begins: the system
  message, the start of the user turn and the ``"Context:\\n"`` header. Its KV ``C_p`` is computed
  once per (model, prompt) and every chunk's KV is computed right after it (see
  ``inference/model/encode.py``).
- chunk ids: a chunk's own tokens, ``ChunkRow.token_ids``, concatenated *as is*: no separator,
  no re-tokenisation of the joined text. Chunks are contiguous slices of a document's tokens, so
  consecutive chunks of one document concatenate to exactly the document's tokens.
- ``query_ids(question)``: the rest of the template: ``"\\n\\nQuestion: <question>"``, the end of
  the user turn and the assistant generation prompt.

Token-boundary choice: the pieces are tokenised separately and their id lists concatenated. A
byte-level BPE tokenising the joined *string* could merge characters across a boundary (for
example the prefix's trailing newline with a chunk's leading spaces), which would give the
precomputed KV a different token sequence from the one the model sees. So ``standard`` RAG must
prefill the concatenation of ids (``standard_ids``), never a re-tokenised joined text; then all
three methods see identical tokens and identical positions.

The pieces come from the tokenizer's own chat template: it is rendered with unique marker strings
in place of the context and the question, and the rendered text is split at the markers. A
tokenizer without a chat template gets a plain-text fallback
(``prefix = system + "\\n\\nContext:\\n"``, with the tokenizer's usual special tokens such as
BOS; ``query = "\\n\\nQuestion: q\\nAnswer:"``).

Worked example (SmolLM2's ChatML template, default system prompt)::

    prefix: "<|im_start|>system\\nAnswer the question using the context. Answer briefly."
            "<|im_end|>\\n<|im_start|>user\\nContext:\\n"
    query:  "\\n\\nQuestion: Who wrote it?<|im_end|>\\n<|im_start|>assistant\\n"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coinrag.schemas.keys import canonical_json, sha256_hex
from coinrag.schemas.qa import require_question

DEFAULT_SYSTEM_PROMPT = "Answer the question using the context. Answer briefly."
CONTEXT_HEADER = "Context:\n"
QUESTION_HEADER = "\n\nQuestion: "
FALLBACK_ANSWER_CUE = "\nAnswer:"

# Markers replaced by the context and the question when the template is rendered. Plain ASCII
# that no template rewrites and no real text contains.
_CTX_MARK = "[[coinrag-context-5f3c9a]]"
_Q_MARK = "[[coinrag-question-5f3c9a]]"

# Bump when the way the pieces are built changes (part of prefix_sha, hence of the KV identity).
PROMPT_LAYOUT_VERSION = 1


class PromptTemplateError(ValueError):
    """The tokenizer's chat template does not render the RAG prompt in a splittable way."""


def _user_content(question: str) -> str:
    return f"{CONTEXT_HEADER}{_CTX_MARK}{QUESTION_HEADER}{question}"


def _encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


@dataclass(frozen=True)
class RagPrompt:
    """The RAG prompt of one tokenizer and system prompt, as token pieces.

    Build it with :meth:`for_tokenizer`. ``prefix_ids`` and ``prefix_sha`` identify the cached
    system-prompt KV ``C_p``: KV computed after another prefix is another asset (``kv_fp``).
    """

    tokenizer: Any = field(repr=False, compare=False)
    system_prompt: str
    prefix_text: str
    prefix_ids: list[int]
    prefix_sha: str
    uses_chat_template: bool
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RagPrompt:
        """Render the tokenizer's chat template (or the fallback) and cut out the prefix."""
        kwargs = dict(chat_template_kwargs or {})
        uses_template = bool(getattr(tokenizer, "chat_template", None))
        if uses_template:
            prefix_text, _ = _render_split(tokenizer, system_prompt, _Q_MARK, kwargs)
            prefix_ids = _encode(tokenizer, prefix_text)
        else:
            prefix_text = f"{system_prompt}\n\n{CONTEXT_HEADER}"
            prefix_ids = _encode(tokenizer, prefix_text, add_special_tokens=True)
            # Only leading special tokens (BOS) belong to the prefix; a tokenizer that appends EOS
            # to every encoding would put it before the context.
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is not None and prefix_ids and prefix_ids[-1] == eos:
                prefix_ids = prefix_ids[:-1]
        prefix_sha = (
            "ps-"
            + sha256_hex(
                "rag-prefix",
                str(PROMPT_LAYOUT_VERSION),
                ",".join(str(int(t)) for t in prefix_ids),
                canonical_json(kwargs),
            )[:24]
        )
        return cls(
            tokenizer=tokenizer,
            system_prompt=system_prompt,
            prefix_text=prefix_text,
            prefix_ids=prefix_ids,
            prefix_sha=prefix_sha,
            uses_chat_template=uses_template,
            chat_template_kwargs=kwargs,
        )

    def query_text(self, question: str) -> str:
        """The text after the context: question, end of the user turn, generation prompt
        (:class:`BlankQuestion` for a blank question)."""
        require_question(question)
        if not self.uses_chat_template:
            return f"{QUESTION_HEADER}{question}{FALLBACK_ANSWER_CUE}"
        prefix_text, rest = _render_split(
            self.tokenizer, self.system_prompt, question, dict(self.chat_template_kwargs)
        )
        if prefix_text != self.prefix_text:
            raise PromptTemplateError(
                "the chat template renders a different prefix when the question changes; "
                "its KV could not be cached once"
            )
        return rest

    def query_ids(self, question: str) -> list[int]:
        """Token ids of :meth:`query_text` (no special tokens added beyond the template's)."""
        return _encode(self.tokenizer, self.query_text(question))

    def standard_ids(self, chunks: Sequence[Sequence[int]], question: str) -> list[int]:
        """What standard RAG prefills: ``prefix_ids + chunk ids (as is) + query_ids(question)``."""
        ids = list(self.prefix_ids)
        for chunk in chunks:
            ids.extend(int(t) for t in chunk)
        ids.extend(self.query_ids(question))
        return ids

    @property
    def n_prefix(self) -> int:
        """``|p|``: the position of a chunk's first token when it follows the prefix."""
        return len(self.prefix_ids)


def _render_split(
    tokenizer: Any, system_prompt: str, question: str, kwargs: dict[str, Any]
) -> tuple[str, str]:
    """Render the chat template and split it at the context marker: (prefix text, query text)."""
    messages = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": _user_content(question)},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    if not isinstance(rendered, str) or rendered.count(_CTX_MARK) != 1:
        raise PromptTemplateError(
            "the chat template did not render the context marker exactly once; "
            "it rewrites message contents"
        )
    prefix_text, rest = rendered.split(_CTX_MARK)
    if not prefix_text.endswith(CONTEXT_HEADER):
        raise PromptTemplateError("the chat template changed the context header")
    return prefix_text, rest
