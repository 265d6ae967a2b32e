"""The tables ``coinrag eval`` writes (``inference/evaluation/evaluate.py``,
``inference/evaluation/report.py``): each column named once here.

- :data:`PER_QUESTION_SCHEMA` (``per_question.parquet``): one row per question x (dataset,
  model, method, retrieval, kc, k);
- :data:`RESULTS_SCHEMA` (``results.parquet``): one row per (dataset, model, method, retrieval,
  kc, k):
  means of F1, EM, recall (over questions with gold documents), active tokens; mean and P99
  TTFT; ``n`` questions;
- :data:`TABLE3_SCHEMA` (``table3.parquet``): per (dataset, model, method, retrieval) and P99 TTFT
  budget,
  the sweep point with the best F1 under it (null F1 where none meets it), with its measures.

``dataset``: the question file's stem; ``model``: the label of the model that answered
(``coinrag eval --model LABEL=REF``); ``retrieval``: the search mode (``coinrag eval
--retrieval``, ``schemas.settings.RETRIEVAL_MODES``); ``label``: how tables and figures name the
row (the method, ``method [model]`` on a model other than the first, ``method (retrieval)`` when
the run compares search modes). F1 / EM / recall are fractions in
``[0, 1]``; times in ms; ``kc`` / ``k`` are 0 where the method does not use them.
"""

from __future__ import annotations

import pyarrow as pa

GROUP_KEYS = ("dataset", "model", "method", "retrieval")
_GROUP = [(name, pa.string()) for name in GROUP_KEYS]
_CONFIG = [("kc", pa.int32()), ("k", pa.int32())]
_QUALITY = [("f1", pa.float64()), ("em", pa.float64()), ("recall", pa.float64())]

RESULTS_SCHEMA = pa.schema(
    [
        *_GROUP,
        *_CONFIG,
        *_QUALITY,
        ("ttft_mean_ms", pa.float64()),
        ("ttft_p99_ms", pa.float64()),
        ("active_tokens", pa.float64()),
        ("n", pa.int32()),
    ]
)

# the measures a Table-3 row copies from the results row that achieved it
TABLE3_MEASURES = [f for f in RESULTS_SCHEMA if f.name not in (*GROUP_KEYS, "kc", "k", "f1")]
TABLE3_SCHEMA = pa.schema(
    [
        *_GROUP,
        ("label", pa.string()),
        ("budget_ms", pa.float64()),
        RESULTS_SCHEMA.field("f1"),  # null: no sweep point meets the budget
        *_CONFIG,
        *TABLE3_MEASURES,
    ]
)

PER_QUESTION_SCHEMA = pa.schema(
    [
        ("qid", pa.int32()),
        ("line", pa.int32()),
        *_GROUP,
        *_CONFIG,
        ("question", pa.string()),
        ("answer", pa.string()),
        ("gold", pa.list_(pa.string())),
        ("gold_doc_ids", pa.list_(pa.string())),
        *_QUALITY,
        ("ttft_ms", pa.float64()),
        ("timings", pa.map_(pa.string(), pa.float64())),
        ("active_tokens", pa.int64()),
        ("evidence_doc_ids", pa.list_(pa.string())),
        ("evidence_citations", pa.list_(pa.string())),  # per evidence: file, pages, section
    ]
)


# ``coinrag eval --retrieval-only`` (``inference/evaluation/retrieval_only.py``): which documents
# each evidence kind found, per search mode. ``evidence``: chunks (the top-kc chunks) | two_stage
# (CoinRAG's nuggets inside them) | one_stage (nuggets of the whole index); ``hit``: a gold
# document among them (hit@kc for chunks); ``recall``: the fraction of the gold documents among
# them; ``rank``: 1-based rank of the first item of a gold document; ``mrr``: mean of 1/rank (0
# for none); ``search_*_ms``: query embedding + index searches.
_RETRIEVAL_KEYS = [
    ("retrieval", pa.string()),
    ("evidence", pa.string()),
    ("kc", pa.int32()),  # 0: not applicable (one_stage)
    ("k", pa.int32()),  # 0: not applicable (chunks)
]
RETRIEVAL_SCHEMA = pa.schema(
    [
        RESULTS_SCHEMA.field("dataset"),
        *_RETRIEVAL_KEYS,
        ("hit", pa.float64()),
        ("recall", pa.float64()),
        ("mrr", pa.float64()),
        ("search_mean_ms", pa.float64()),
        ("search_p99_ms", pa.float64()),
        ("n", pa.int32()),
    ]
)
RETRIEVAL_PER_QUESTION_SCHEMA = pa.schema(
    [
        ("qid", pa.int32()),
        RESULTS_SCHEMA.field("dataset"),
        *_RETRIEVAL_KEYS,
        ("question", pa.string()),
        ("gold_doc_ids", pa.list_(pa.string())),
        ("evidence_doc_ids", pa.list_(pa.string())),
        ("evidence_citations", pa.list_(pa.string())),  # per evidence: file, pages, section
        ("hit", pa.float64()),
        ("recall", pa.float64()),
        ("rank", pa.int32()),
        ("search_ms", pa.float64()),
    ]
)
