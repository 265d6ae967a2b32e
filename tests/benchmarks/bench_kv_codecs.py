"""The KV codecs on real text and real questions: bytes, error per layer, attention-logit and
next-token-logit error of coinrag's assembled contexts, and F1, with keys quantized before RoPE
(what the int8 / int4 stores do) and after it (the alternative, measured here).

    python tests/benchmarks/bench_kv_codecs.py [--work DIR] [--limit 176] [--kc 4] [--k 10]
        [--kv-dtype bfloat16] [--store STORE] [--threads 2] [--no-f1] [--json PATH]

Corpus and questions: the FAQ pages of Debian's ``python3.11-doc`` and their 176 question /
answer pairs (``infra/python_faq.py OUT --subset 0``), built once into ``WORK/store`` with
``coinrag build`` (the ``rules`` extractor, SmolLM2-135M's KV at ``--kv-dtype``, codec
``none``; a second run reuses it). The float store is the reference.

Variants (each reads the float store's entries through a codec round trip, exactly what a
store of that codec returns: checked against a real int4 store's reads at the start):

- ``int8`` / ``int4`` ``pre``: the store's codecs (keys per channel within each 16-token block,
  rotated back to position 0 first; values per token);
- ``int8`` / ``int4`` ``post``: the same quantization of the keys as cached (after RoPE);
- ``int4 tokenK``: keys per token over head_dim like the values (LMDeploy's layout), pre-RoPE:
  what per-channel keys (KIVI) are compared with;
- ``int2 pre`` / ``int2mix pre``: the 2-bit codecs (``storage/kv/lowbit.py``, ``mixed.py``) in
  their 64-token blocks.

Per question (``--limit`` of them): coinrag's two-stage retrieval (``--kc``, ``--k``) once;
the context assembled from each variant's slices; the query prefilled on it. Measured against
the float context: per layer ``‖x̂ − x‖ / ‖x‖`` of the entries read (mean over entries, mean
and worst layer), the attention logits of the float run's queries over the context keys
(``mean |Δ| / mean |logit|`` per layer: mean over layers, worst layer), the next-token KL
divergence over the query's positions and the top-1 agreement; then F1 / EM / recall of
``coinrag eval`` (``inference.evaluation.evaluate.evaluate``) on the same questions, per variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from coinrag.inference.context.assemble import KvSlice, assemble_context  # noqa: E402
from coinrag.inference.model.encode import keys_to_position_zero, to_dynamic_cache  # noqa: E402
from coinrag.inference.rope import RopeSpec, reset_rotary  # noqa: E402
from coinrag.storage.kv import KvLayout, KvStore  # noqa: E402
from coinrag.storage.kv.quantize import dequantize, quantize  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    codec: str  # none | int8 | int4
    pre: bool = True  # keys rotated to position 0 before quantizing
    token_keys: bool = False  # keys per token (over head_dim) instead of per channel

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "int2": 2, "int2mix": 2}.get(self.codec, 16)


VARIANTS = [
    Variant("none", "none"),
    Variant("int8 pre", "int8"),
    Variant("int8 post", "int8", pre=False),
    Variant("int4 pre", "int4"),
    Variant("int4 post", "int4", pre=False),
    Variant("int4 tokenK", "int4", token_keys=True),
    Variant("int2 pre", "int2"),
    Variant("int2mix pre", "int2mix"),
]


class ReaderLayout:
    """The float store's layout as the context builders see it (``entry_shape``,
    ``torch_dtype``, ...), but with the variant's ``keys_at_zero``."""

    def __init__(self, layout: KvLayout, keys_at_zero: bool) -> None:
        self._layout = layout
        self.keys_at_zero = keys_at_zero

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layout, name)


class CodecReader:
    """The float store read through a codec round trip: ``read_slices``,
    ``read_slices_into``, ``manifest`` and ``layout``, as ``RagEngine`` uses a ``KvStore``."""

    def __init__(self, kv: KvStore, variant: Variant, spec: RopeSpec, n_prefix: int) -> None:
        self.kv = kv
        self.variant = variant
        self.spec = spec
        self.p = n_prefix
        lay = kv.layout
        self.codec_layout = KvLayout(
            lay.model_fp,
            lay.prefix_sha,
            lay.layers,
            lay.kv_heads,
            lay.head_dim,
            lay.dtype,
            kv_codec=variant.codec,
        )
        self.keys_at_zero = variant.codec != "none" and variant.pre
        self.layout = ReaderLayout(lay, self.keys_at_zero)
        self._cache: dict[str, torch.Tensor] = {}
        self.errors: dict[str, torch.Tensor] = {}  # content_key -> (L, 2) relative error

    def manifest(self) -> dict[str, Any]:
        return self.kv.manifest()

    def entry(self, ck: str) -> torch.Tensor:
        got = self._cache.get(ck)
        if got is None:
            got = self._round_trip(ck)
            self._cache[ck] = got
        return got

    def _round_trip(self, ck: str) -> torch.Tensor:
        float_kv = self.kv.read_entry(ck)
        v = self.variant
        if v.codec == "none":
            return float_kv
        x = keys_to_position_zero(float_kv, self.spec, self.p) if v.pre else float_kv.float()
        if v.token_keys:
            levels = 2**v.bits - 1
            parts = [dequantize(*quantize(x[:, i], -1, levels)) for i in (0, 1)]
            out = torch.stack(parts, dim=1).to(float_kv.dtype)
        else:
            lay = self.codec_layout
            out = lay.codec.decode(lay.codec.encode(x, lay), lay)[:, :, :, : x.shape[3]]
        # error per layer, in the float entry's own frame (rotations keep norms)
        ref = x.to(torch.float64)
        diff = (out.to(torch.float64) - ref).flatten(2).norm(dim=2)
        self.errors[ck] = diff / ref.flatten(2).norm(dim=2)
        return out

    def read_slices(self, requests: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        return [self.entry(ck)[:, :, :, s:e].contiguous() for ck, s, e in requests]

    def read_slices_into(
        self, requests: list[tuple[str, int, int]], out: torch.Tensor, rope: object = None
    ) -> bool:
        """The slices one after another along ``out``'s token axis (``KvStore``'s contract);
        keys never rotated here (False: the caller rotates them)."""
        at = 0
        for piece in self.read_slices(requests):
            n = piece.shape[-2]
            out[..., at : at + n, :] = piece
            at += n
        return False


def bytes_per_token(variant: Variant, layout: KvLayout) -> float:
    """Stored bytes per token relative to raw bfloat16, in the codec's default block (a
    layout made with the codec: ``dataclasses.replace`` of a ``none`` layout would keep its
    4-token blocks, whose scales cost ``int2`` 0.2656 instead of 0.1411; a store adds its shard
    layout: 0.1426 measured)."""
    raw = layout.layers * 2 * layout.kv_heads * layout.head_dim * 2
    if variant.codec == "none":
        return layout.raw_token_bytes / raw
    if variant.token_keys:  # codes + a float16 minimum and step per token, keys and values
        lh = layout.layers * layout.kv_heads
        return (2 * lh * (layout.head_dim * variant.bits // 8 + 4)) / raw
    lay = KvLayout(
        "m", "p", layout.layers, layout.kv_heads, layout.head_dim, "bfloat16",
        kv_codec=variant.codec,
    )  # fmt: skip
    return lay.block_bytes / lay.block_tokens / raw


class QueryCapture:
    """The query vectors of every layer (after RoPE) of the forwards run while installed."""

    def __init__(self, model: Any) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.q: dict[int, torch.Tensor] = {}
        self.handles = []
        layers = model.model.layers
        for i, layer in enumerate(layers):
            attn = layer.self_attn

            def hook(mod, args, kwargs, i=i, attn=attn):
                h = kwargs.get("hidden_states", args[0] if args else None)
                cos, sin = kwargs["position_embeddings"]
                b, t, _ = h.shape
                q = attn.q_proj(h).view(b, t, -1, attn.head_dim)
                if hasattr(attn, "q_norm"):
                    q = attn.q_norm(q)
                q = q.transpose(1, 2)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                self.q[i] = q[0].float()

            self.handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def prepare(work: Path, kv_dtype: str, store: Path | None = None) -> tuple[Path, Path]:
    """The FAQ corpus and questions, and the float store built from them (once; ``store``: one
    already built from them, with codec ``none``)."""
    data = work / "faq"
    if not (data / "questions.jsonl").is_file():
        subprocess.run(
            [sys.executable, str(REPO / "infra" / "python_faq.py"), str(data), "--subset", "0"],
            check=True,
        )
    store = store or work / "store"
    if not (store / "coinrag.toml").is_file():
        # the CLI (its temporary Prefect server waits longer than an ephemeral one on a busy
        # machine)
        t0 = time.perf_counter()
        coinrag = str(Path(sys.executable).with_name("coinrag"))
        subprocess.run(
            [coinrag, "build", str(data / "corpus_subset.jsonl"), "--store", str(store)]
            + ["--extractor", "rules", "--kv-dtype", kv_dtype, "--kv-codec", "none"],
            check=True,
        )
        print(f"built {store} in {time.perf_counter() - t0:.0f} s")
    return data / "questions.jsonl", store


def check_against_a_real_store(reader: CodecReader, ck: str, work: Path) -> None:
    """The emulated int4 round trip is what an int4 store returns, bit for bit."""
    from coinrag.storage.store import Store

    kv = reader.kv
    lay = dataclasses.replace(reader.codec_layout, slots_per_shard=4)
    real = KvStore.create(Store.at(work / "int4-check").init(), lay)
    row = kv.manifest()[ck]
    entry = keys_to_position_zero(kv.read_entry(ck), reader.spec, reader.p)

    @dataclasses.dataclass
    class Ref:
        chunk_id: str
        content_key: str
        n_tokens: int

    real.write_entries([(Ref(row.chunk_id, ck, row.tokens), entry)], "bench")  # type: ignore[list-item]
    assert torch.equal(real.read_entry(ck), reader.entry(ck)), "emulation != int4 store"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=176)
    ap.add_argument("--kc", type=int, default=4)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--store", type=Path, help="a store of the FAQ pages, codec none (reused)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-f1", action="store_true")
    ap.add_argument(
        "--variants",
        nargs="+",
        help="only these variants (default: all)",
    )
    ap.add_argument(
        "--no-diagnostics", action="store_true", help="F1 only (no per-question error measures)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-kv-codecs-"))
    work.mkdir(parents=True, exist_ok=True)
    questions_path, store = prepare(work, args.kv_dtype, args.store)
    from coinrag.inference.evaluation.evaluate import evaluate, load_questions
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.methods.assets import StoredKv

    engine = RagEngine.open(str(store), max_new_tokens=args.max_new_tokens, methods=("coinrag",))
    model = engine.model
    context = engine.asset(StoredKv)  # the coinrag method's stored-KV context (shared)
    float_kv = context.kv
    spec = context.spec
    prefix_kv = context.prefix_kv
    p = engine.prompt.n_prefix
    variants = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    if not variants:
        raise SystemExit(f"error: --variants: none of {args.variants} is a variant")
    readers = {v.name: CodecReader(float_kv, v, spec, p) for v in variants}
    questions = load_questions(questions_path)[: args.limit]
    first = engine.retriever.two_stage(questions[0].question, kc=args.kc, k=args.k)
    int4_pre = next(v for v in VARIANTS if v.name == "int4 pre")
    int4 = CodecReader(float_kv, int4_pre, spec, p)
    check_against_a_real_store(int4, first.evidence[0].content_key, work)
    stats: dict[str, dict[str, list[float]]] = {v.name: {} for v in variants if v.codec != "none"}
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    capture = QueryCapture(model)
    t0 = time.perf_counter()
    for qi, q in enumerate([] if args.no_diagnostics else questions):
        retrieval = engine.retriever.two_stage(q.question, kc=args.kc, k=args.k)
        requests = [(e.content_key, e.tok_start, e.tok_end) for e in retrieval.evidence]
        query_ids = engine.prompt.query_ids(q.question)
        total = p + sum(e - s for _, s, e in requests)
        ref = None
        for v in [VARIANTS[0], *(v for v in variants if v.codec != "none")]:
            reader = readers.get(v.name) or CodecReader(float_kv, v, spec, p)
            readers[v.name] = reader
            blocks = reader.read_slices(requests)
            slices = [
                KvSlice(b, p + s, p + float_kv.manifest()[ck].tokens, reader.keys_at_zero)
                for b, (ck, s, _) in zip(blocks, requests, strict=True)
            ]
            ctx = assemble_context(prefix_kv, slices, spec, new_seq_len=total + len(query_ids))
            reset_rotary(model)
            with torch.inference_mode():
                out = model(
                    input_ids=torch.tensor([query_ids]),
                    past_key_values=to_dynamic_cache(ctx, model.config),
                    position_ids=torch.arange(total, total + len(query_ids))[None],
                )
            logits = out.logits[0].float()
            if ref is None:
                ref = (logits, {i: t.clone() for i, t in capture.q.items()}, ctx)
                continue
            ref_logits, ref_q, ref_ctx = ref
            attn = []
            for layer in range(ctx.shape[0]):
                qv = ref_q[layer]
                scale = qv.shape[-1] ** -0.5
                k_ref = ref_ctx[layer, 0].float().repeat_interleave(groups, 0)
                k_got = ctx[layer, 0].float().repeat_interleave(groups, 0)
                a = qv @ k_ref.transpose(1, 2) * scale
                b = qv @ k_got.transpose(1, 2) * scale
                attn.append(((b - a).abs().mean() / a.abs().mean()).item())
            lp_ref = torch.log_softmax(ref_logits, -1)
            lp = torch.log_softmax(logits, -1)
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
            s = stats[v.name]
            s.setdefault("attn_logit_err", []).append(sum(attn) / len(attn))
            s.setdefault("attn_logit_err_worst_layer", []).append(max(attn))
            s.setdefault("next_token_kl", []).append(kl.mean().item())
            top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
            s.setdefault("top1_agreement", []).append(top1)
        if (qi + 1) % 10 == 0:
            print(f"{qi + 1}/{len(questions)} questions ({time.perf_counter() - t0:.0f} s)")
    capture.close()
    results: dict[str, Any] = {}
    for v in variants:
        row: dict[str, Any] = {"bytes_over_raw_bf16": round(bytes_per_token(v, float_kv.layout), 4)}
        reader = readers[v.name]
        if reader.errors:
            errs = torch.stack(list(reader.errors.values()))  # (entries, L, 2)
            per_layer = errs.mean(0)
            for kind, i in (("K", 0), ("V", 1)):
                row[f"rel_err_{kind}_mean"] = round(per_layer[:, i].mean().item(), 5)
                row[f"rel_err_{kind}_worst_layer"] = round(per_layer[:, i].max().item(), 5)
        for key, values in stats.get(v.name, {}).items():
            row[key] = round(sum(values) / len(values), 6)
        if not args.no_f1:
            context.kv = reader  # type: ignore[assignment]  # what coinrag reads now
            table = evaluate(
                store,
                questions_path,
                work / "eval" / v.name.replace(" ", "-"),
                methods=("coinrag",),
                sweep=[(args.kc, args.k)],
                limit=args.limit,
                engine=engine,
                quiet=True,
            ).to_pylist()
            agg = next(r for r in table if r.get("method") == "coinrag")
            row |= {m: agg[m] for m in ("f1", "em", "recall", "n")}
        results[v.name] = row
        print(v.name, json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {**vars(args), "work": str(work), "json": str(args.json)},
                    "results": results,
                },
                indent=1,
                default=str,  # paths among the args
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
