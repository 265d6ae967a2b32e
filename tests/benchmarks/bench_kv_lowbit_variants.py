"""Where 2 bits per value go (issue 36): KV quantizers emulated over a float (bf16 ``none``)
store's entries, keys and values separately, and what each does to the next token.

    python tests/benchmarks/bench_kv_lowbit_variants.py --store W/store \
        --questions W/faq/questions.jsonl --limit 30 \
        --variants int2/int2 int4/int4 int2/exact exact/int2 km:16,0,32,0/exact \
        exact/had2 exact/chan2 km:16,0,32,0/chan2 [--json PATH]

A variant is ``KEYS/VALUES``, each half quantized in 64-token blocks (``--block``; keys rotated
to position 0 first, as the quantized stores keep them) with ``int2``'s one-byte scales and clipping
(``storage/kv/lowbit.py``) unless named otherwise:

- ``exact``: as stored (bf16); ``int2`` / ``int3`` / ``int4``: uniform codes, keys per channel
  over the block, values per token over ``head_dim``;
- ``km:a,b,c,d`` (keys or values): per block, layer and head the channels ranked by range over
  the block's tokens; the widest ``a`` at 4 bits, the next ``b`` at 3, ``c`` at 2, ``d`` at 1,
  the rest their mean (``km:16,0,32,0`` at ``head_dim`` 64 is ``int2mix``'s keys,
  ``storage/kv/mixed.py``);
- ``kmq:a,b,c,d`` (keys): as ``km``, the channels ranked by range times the RMS of the queries
  that read them (per layer, key-value head and RoPE channel pair, before RoPE, measured on the
  texts of ``--query-weights CORPUS.jsonl``: the model run over each, its query projections
  hooked); ``kmw:a,b,c,d``: the same with the queries' scale read off the query projection's
  weights (no text); ``vmq:a,b,c,d`` (values): as ``km`` per channel, ranked by range times
  the norm of the output projection's columns that read the channel;
- ``kml:a,b,c,d``: as ``km``, the 2-bit channels by Lloyd-Max levels (``lloyd``'s ideal float
  scales, so optimistic in bytes); values ``chanlm2``: the same per value channel;
- values: ``chan2`` (2-bit per channel over the block: ``int2mix``'s values), ``had2`` /
  ``had3`` (a normalized 64x64 Hadamard rotation of each value vector, then per token),
  ``hadlm2z`` / ``hadlm3z`` (rotated, Lloyd-Max levels of a unit Gaussian on one RMS scale per
  token), ``lm2`` (Lloyd-Max per token, mean and RMS), ``mix:LAYERS:BASE`` (BASE, its 3-bit
  form on the listed layers), ``lay:LAYERS:KIND:BASE`` (BASE, KIND on the listed layers: e.g.
  ``lay:0,1:int4:km:16,0,32,0`` for keys);
- ``pca:BASE``: each vector turned onto the principal axes of its layer and head (keys or
  values, the centered covariance over every ``--pca``-th entry of the store), BASE there, turned
  back; ``pcaq:BASE`` (keys): the keys scaled per channel by the queries' RMS (``kmq``'s weights,
  ``--query-weights``) first and their principal axes taken there; ``pcao:BASE`` (values): the
  values times ``G^1/2`` first, ``G`` the Gram matrix of the output projection's columns that
  read the head (an error's size in the attention block's output), axes taken there;
- ``tokx:N:BASE``: per block, layer and head the ``N`` tokens farthest from the block's channel
  means kept exact and out of BASE's ranges (token outliers);
- ``stored:BASE`` (keys): in the key basis a store's ``int2basis`` KV holds (``--basis
  STORE``: ``k @ forward``, BASE there, ``@ inverse``), e.g. the codec's own keys are
  ``stored:km:16,0,32,0``.

``--f1 N`` (``--f1-methods coinrag turborag``, ``--f1-out DIR``): then ``coinrag eval``'s own
loop (``evaluate``, kc 4, k 10) on the first N questions, the store read as stored (not with
``--f1-no-reference``) and through each variant: the answers' F1 and recall per method.

Per question (coinrag's two-stage retrieval, kc 4, k 10; the context assembled from each
variant's slices, the query prefilled on it): against the bf16 context, the next-token KL
divergence over the query's positions (``kl``) and at its last one (``kl_first``: the first
answer token's distribution), the top-1 agreement likewise; per layer ``‖x̂ − x‖ / ‖x‖`` of the
entries read (``relK``, ``relV``). Emulated: the scales' units are those of each width's
quantization, so ``km`` rows match the codec's relative error to 4 digits, not bit for bit.

``--codec-errors int8 int4 int2 int2mix`` (with ``--limit 0``): the codecs themselves over every
entry of the store, per-layer ``‖x̂ − x‖ / ‖x‖`` of K (at position 0) and V, mean and worst
layer of the mean over entries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))

import bench_kv_codecs as B  # noqa: E402
import torch  # noqa: E402

from coinrag.inference.model.encode import keys_to_position_zero  # noqa: E402
from coinrag.storage.kv.lowbit import quantize_fine_scales  # noqa: E402

BLOCK = 64


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


H64 = hadamard(64)


def blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(L, H, T, D) -> (k, L, H, B, D) padded with the last token."""
    L, H, n, D = x.shape
    k = max(1, -(-n // BLOCK))
    if k * BLOCK > n:
        x = torch.cat([x, x[:, :, n - 1 : n].expand(L, H, k * BLOCK - n, D)], 2)
    return x.reshape(L, H, k, BLOCK, D).permute(2, 0, 1, 3, 4).contiguous(), n


def unblocks(y: torch.Tensor, n: int) -> torch.Tensor:
    k, L, H, Bt, D = y.shape
    return y.permute(1, 2, 0, 3, 4).reshape(L, H, k * Bt, D)[:, :, :n]


def fine(x, dim, levels, clips=(0.0, 0.1, 0.2)):
    codes, z, c, lo_u, st_u = quantize_fine_scales(x, dim, levels, clips)
    return codes.float() * (c.float() * st_u.float()) + z.float() * lo_u.float()


# Lloyd-Max levels for a unit Gaussian
LM = {
    2: torch.tensor([-1.510, -0.4528, 0.4528, 1.510]),
    3: torch.tensor([-2.152, -1.344, -0.7560, -0.2451, 0.2451, 0.7560, 1.344, 2.152]),
}


def lloyd(x, dim, bits, mults=(0.8, 0.9, 1.0, 1.1, 1.2, 1.35)):
    """Symmetric non-uniform: per group RMS scale (ideal float), Lloyd-Max levels, best of a
    few scale multipliers (least squared error)."""
    lv = LM[bits]
    mean = x.mean(dim=dim, keepdim=True)
    xc = x - mean
    rms = xc.square().mean(dim=dim, keepdim=True).sqrt().clamp_min(1e-12)
    best_err, best = None, None
    for m in mults:
        s = rms * m
        idx = (xc / s).unsqueeze(-1).sub(lv).abs().argmin(-1)
        y = lv[idx] * s + mean
        err = (y - x).square().sum(dim=dim, keepdim=True)
        if best is None:
            best_err, best = err, y
        else:
            better = err < best_err
            best = torch.where(better, y, best)
            best_err = torch.where(better, err, best_err)
    return best


def lloyd0(x, dim, bits, mults=(0.8, 0.9, 1.0, 1.1, 1.2, 1.35)):
    """Same, zero-mean assumed (one scale per group only)."""
    lv = LM[bits]
    rms = x.square().mean(dim=dim, keepdim=True).sqrt().clamp_min(1e-12)
    best_err, best = None, None
    for m in mults:
        s = rms * m
        idx = (x / s).unsqueeze(-1).sub(lv).abs().argmin(-1)
        y = lv[idx] * s
        err = (y - x).square().sum(dim=dim, keepdim=True)
        if best is None:
            best_err, best = err, y
        else:
            better = err < best_err
            best = torch.where(better, y, best)
            best_err = torch.where(better, err, best_err)
    return best


# (1, L, H, D, D) principal axes: keys (3), values (4), keys scaled by the queries' RMS ("q"),
# values times G^1/2 ("o")
PCA: dict[int | str, torch.Tensor | None] = {3: None, 4: None, "q": None, "o": None}
STORED_BASIS = None  # --basis: the key basis of a store's int2basis KV (storage/kv/basis.py)
OUT_ROOT: tuple[torch.Tensor, torch.Tensor] | None = None  # (1, L, H, D, D): G^1/2, G^-1/2


def out_root(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and key-value head ``G = sum_h W_o,h^T W_o,h`` over the query heads of its
    group: ``(G^1/2, G^-1/2)`` as ``(1, L, H, D, D)``: an error ``e`` in a value moves the
    attention block's output by ``|e G^1/2|``."""
    n_q, n_kv, d = head_dims(model)
    roots, invs = [], []
    for layer in model.model.layers:
        w = layer.self_attn.o_proj.weight.detach().double().view(-1, n_kv, n_q // n_kv, d)
        g = torch.einsum("okgi,okgj->kij", w, w)
        vals, vecs = torch.linalg.eigh(g)
        vals = vals.clamp_min(vals.max() * 1e-8)
        roots.append(vecs @ torch.diag_embed(vals.sqrt()) @ vecs.transpose(-1, -2))
        invs.append(vecs @ torch.diag_embed(vals.rsqrt()) @ vecs.transpose(-1, -2))
    return torch.stack(roots).float()[None], torch.stack(invs).float()[
        None
    ]  # (L, H, D, D) keys (3), values (4)


def principal_axes(entries: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and head the eigenvectors of the centered covariance over every token of
    ``entries`` (each ``(L, 2, H, T, D)``, keys at position 0), largest first, as ``(1, L, H,
    D, D)`` column matrices, for keys and for values."""
    out = []
    for half in (0, 1):
        x = torch.cat([e[:, half].double() for e in entries], 2)  # (L, H, T, D)
        x = x - x.mean(2, keepdim=True)
        cov = x.transpose(-1, -2) @ x / x.shape[2]
        vals, vecs = torch.linalg.eigh(cov)
        out.append(vecs.flip(-1).float()[None])
        share = (vals.flip(-1).cumsum(-1) / vals.sum(-1, keepdim=True))[..., 7].mean()
        print(f"{'KV'[half]}: top-8 axes hold {share:.3f} of the variance (mean)", flush=True)
    return out[0], out[1]


QUERY_RMS: torch.Tensor | None = None  # (L, H, D): set by --query-weights (kmq variants)
OUT_NORM: torch.Tensor | None = None  # (L, H, D): set by --query-weights (vmq variants)
QUERY_WEIGHT_NORM: torch.Tensor | None = None  # (L, H, D): set by --query-weights (kmw variants)
WEIGHTED = {"kmq:": "QUERY_RMS", "kmw:": "QUERY_WEIGHT_NORM", "vmq:": "OUT_NORM"}


def keymix(x, counts, weighted=None, two_bit=None):
    """x (k, L, H, B, D): channels ranked per (k, L, H) by range (``weighted`` (L, H, D), e.g.
    ``QUERY_RMS``: range times the channel's weight); the top counts[0] at 4 bits,
    the next counts[1] at 3, counts[2] at 2, counts[3] at 1, the rest their mean."""
    r = x.amax(3) - x.amin(3)  # (k, L, H, D)
    if weighted is not None:
        r = r * weighted
    order = torch.sort(r, dim=-1, descending=True, stable=True).indices
    rank = order.argsort(-1)  # rank of each channel
    out = x.mean(3, keepdim=True).expand_as(x).clone()
    start = 0
    for bits, n in zip((4, 3, 2, 1), counts, strict=True):
        if n == 0:
            continue
        sel = ((rank >= start) & (rank < start + n)).unsqueeze(3).expand_as(x)
        y = two_bit(x) if bits == 2 and two_bit is not None else fine(x, 3, 2**bits - 1)
        out = torch.where(sel, y, out)
        start += n
    return out


def outlier_tokens(base: Callable[[torch.Tensor], torch.Tensor], n: int):
    """Per block, layer and head the ``n`` tokens farthest from the block's channel means
    (in units of each channel's range over the block, the largest over channels) kept exact
    and left out of the ranges ``base`` quantizes the others by."""

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(3, keepdim=True)
        span = (x.amax(3, keepdim=True) - x.amin(3, keepdim=True)).clamp_min(1e-12)
        far = ((x - mean) / span).abs().amax(-1)  # (k, L, H, B)
        top = far.topk(n, dim=-1).indices  # (k, L, H, n)
        sel = torch.zeros_like(far, dtype=torch.bool).scatter_(-1, top, True).unsqueeze(-1)
        kept = torch.where(sel, mean.expand_as(x), x)
        return torch.where(sel, x, base(kept))

    return round_trip


FINE_LEVELS = {"int2": 3, "int3": 7, "int4": 15}  # uniform codes, int2's scales and clipping
LLOYD = {"lm2": (lloyd, 2), "lm2z": (lloyd0, 2), "lm3z": (lloyd0, 3)}  # Lloyd-Max levels
ROTATED = {"had2": "int2", "had3": "int3", "hadlm2": "lm2", "hadlm2z": "lm2z", "hadlm3z": "lm3z"}


def quantizer(kind: str, dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The round trip of ``x`` ``(k, L, H, B, D)`` float32 by ``kind`` (module docstring),
    groups over ``dim``: 3, a channel over the block's tokens (keys); 4, a token over ``D``
    (values). ``chan2`` is per channel whatever ``dim``; ``had*`` rotate each vector over
    ``D`` first; ``mix:LAYERS:BASE`` quantizes the listed layers by BASE's 3-bit form."""
    if kind == "exact":
        return lambda x: x
    if kind in FINE_LEVELS:
        return lambda x: fine(x, dim, FINE_LEVELS[kind])
    if kind in LLOYD:
        levels_of, bits = LLOYD[kind]
        return lambda x: levels_of(x, dim, bits)
    if kind in ROTATED:
        inner = quantizer(ROTATED[kind], dim)
        return lambda x: inner(x @ H64) @ H64.T
    if kind == "chan2":
        return quantizer("int2", 3)
    if kind == "chanlm2":  # per channel over the block, Lloyd-Max levels (ideal float scales)
        return lambda x: lloyd(x, 3, 2)
    if kind.startswith("kml:"):  # as km, the 2-bit channels by Lloyd-Max levels
        counts = [int(i) for i in kind[4:].split(",")]
        return lambda x: keymix(x, counts, two_bit=lambda y: lloyd(y, 3, 2))
    if kind.startswith("km:"):  # km:a,b,c,d channels at 4, 3, 2, 1 bits, the rest their mean
        counts = [int(i) for i in kind[3:].split(",")]
        return lambda x: keymix(x, counts)
    if kind[:4] in WEIGHTED:  # kmq / kmw / vmq: as km, ranked by range x a channel weight
        counts, name = [int(i) for i in kind[4:].split(",")], WEIGHTED[kind[:4]]
        if globals()[name] is None:
            raise SystemExit(f"error: variant {kind!r} needs --query-weights CORPUS.jsonl")
        return lambda x: keymix(x, counts, weighted=globals()[name])
    if kind.startswith("lay:"):  # lay:<layers csv>:<kind of those layers>:<base>
        _, spec, high_kind, base = kind.split(":", 3)
        chosen = [int(i) for i in spec.split(",")]
        rest, picked = quantizer(base, dim), quantizer(high_kind, dim)

        def by_layer(x: torch.Tensor) -> torch.Tensor:
            y = rest(x)
            y[:, chosen] = picked(x[:, chosen])
            return y

        return by_layer
    if kind.startswith("pca:"):  # pca:<base>: the store's principal axes, then BASE
        inner, rot = quantizer(kind[4:], dim), PCA[dim]
        if rot is None:
            raise SystemExit(f"error: variant {kind!r} needs --calibrate or --pca")
        return lambda x: inner(x @ rot) @ rot.transpose(-1, -2)
    if kind.startswith("pcaq:"):  # keys: scaled by the queries' RMS, their principal axes
        if PCA["q"] is None or QUERY_RMS is None:
            raise SystemExit(
                f"error: variant {kind!r} needs --calibrate, or --pca and --query-weights"
            )
        inner, rot, w = quantizer(kind[5:], dim), PCA["q"], QUERY_RMS[:, :, :, None]
        return lambda x: (inner((x * w) @ rot) @ rot.transpose(-1, -2)) / w
    if kind.startswith("stored:"):  # keys in the basis an int2basis KV store holds (--basis)
        if STORED_BASIS is None:
            raise SystemExit(f"error: variant {kind!r} needs --basis STORE")
        inner, basis = quantizer(kind[7:], dim), STORED_BASIS
        return lambda x: inner(x @ basis.forward) @ basis.inverse
    if kind.startswith("pcao:"):  # values: whitened by the output projection, principal axes
        if PCA["o"] is None or OUT_ROOT is None:
            raise SystemExit(f"error: variant {kind!r} needs --calibrate or --pca")
        inner, rot, (sq, inv) = quantizer(kind[5:], dim), PCA["o"], OUT_ROOT
        return lambda x: (inner((x @ sq) @ rot) @ rot.transpose(-1, -2)) @ inv
    if kind.startswith("tokx:"):  # tokx:<n>:<base>: per block n outlier tokens kept exact
        _, n, base = kind.split(":", 2)
        return outlier_tokens(quantizer(base, dim), int(n))
    if kind.startswith("mix:"):  # mix:<layers 3-bit csv>:<base>: lay with BASE's 3-bit form
        _, spec, base = kind.split(":")
        return quantizer(f"lay:{spec}:{base.replace('2', '3')}:{base}", dim)
    raise KeyError(f"unknown quantizer {kind!r}")


class Reader(B.CodecReader):
    def __init__(self, kv, name, spec, p, kf, vf):
        super().__init__(kv, B.Variant(name, "int4"), spec, p)
        self.kf, self.vf = kf, vf

    def _round_trip(self, ck):
        float_kv = self.kv.read_entry(ck)
        x = keys_to_position_zero(float_kv, self.spec, self.p)
        kb, n = blocks(x[:, 0])
        vb, _ = blocks(x[:, 1])
        k = unblocks(self.kf(kb), n)
        v = unblocks(self.vf(vb), n)
        out = torch.stack([k, v], 1).to(float_kv.dtype)
        ref = x.to(torch.float64)
        diff = (out.to(torch.float64) - ref).flatten(2).norm(dim=2)
        self.errors[ck] = diff / ref.flatten(2).norm(dim=2)
        return out

    def __getattr__(self, name: str):  # the rest of KvStore's reads (chunk_tokens, ...)
        if name == "kv":
            raise AttributeError(name)
        return getattr(self.kv, name)


def calibrate_axes(model, entries: list[torch.Tensor]) -> None:
    """``PCA`` and ``OUT_ROOT`` from ``entries`` (each ``(L, 2, H, T, D)``, keys at position
    0); the ``"q"`` axes only where ``--query-weights`` set ``QUERY_RMS``."""
    global OUT_ROOT
    PCA[3], PCA[4] = principal_axes(entries)
    if QUERY_RMS is not None:
        w = torch.stack([QUERY_RMS[0], torch.ones_like(QUERY_RMS[0])], 1)  # (L, 2, H, D)
        PCA["q"], _ = principal_axes([e * w[..., None, :] for e in entries])
    OUT_ROOT = out_root(model)
    root = OUT_ROOT[0][0]  # (L, H, D, D)
    both = torch.stack([torch.eye(root.shape[-1]).expand_as(root), root], 1)[:, :, :, None]
    _, PCA["o"] = principal_axes([(e.unsqueeze(-2) @ both).squeeze(-2) for e in entries])


def answer_f1(engine, context, readers, args) -> dict[str, dict[str, float]]:
    """F1 / recall of ``--f1-methods`` on the first ``--f1`` questions (kc 4, k 10), the store
    read as stored (``none``) and through each variant's round trip: ``coinrag eval``'s own
    loop (``evaluate``), one directory per variant under ``--f1-out``."""
    from coinrag.inference.evaluation.evaluate import evaluate

    float_kv, out = context.kv, {}
    reference = [] if args.f1_no_reference else [("none", float_kv)]
    for name, reader in [*reference, *readers.items()]:
        context.kv = reader
        table = evaluate(
            args.store,
            args.questions,
            args.f1_out / name.replace("/", "_").replace(":", "-"),
            methods=tuple(args.f1_methods),
            sweep=[(4, 10)],
            limit=args.f1,
            engine=engine,
            quiet=True,
        ).to_pylist()
        for row in table:
            if row.get("method") in args.f1_methods:
                got = {m: row[m] for m in ("f1", "recall", "n")}
                out.setdefault(name, {})[row["method"]] = got
        print("F1", name, json.dumps(out.get(name)), flush=True)
    context.kv = float_kv
    return out


def store_errors(float_kv, spec, p: int, codecs: list[str]) -> None:
    """Per codec, the per-layer relative error of K (at position 0) and V over every entry of
    the float store, through the codec itself (mean over entries; mean and worst layer)."""
    from coinrag.storage.kv import KvLayout

    lay0 = float_kv.layout
    errs: dict[str, list[torch.Tensor]] = {c: [] for c in codecs}
    for ck in float_kv.manifest():
        x = keys_to_position_zero(float_kv.read_entry(ck), spec, p)
        ref = x.double()
        for c in codecs:
            lay = KvLayout(
                "m", "p", lay0.layers, lay0.kv_heads, lay0.head_dim, lay0.dtype, kv_codec=c
            )
            got = lay.codec.decode(lay.codec.encode(x, lay), lay)[:, :, :, : x.shape[3]].double()
            errs[c].append((got - ref).flatten(2).norm(dim=2) / ref.flatten(2).norm(dim=2))
    for c, e in errs.items():
        m = torch.stack(e).mean(0)
        k, v = m[:, 0], m[:, 1]
        worst = f"K {k.mean():.4f} / {k.max():.4f}, V {v.mean():.4f} / {v.max():.4f}"
        print(f"{c}: {len(e)} entries, {worst}")


def stored_basis(store: Path):
    """The key basis of ``store``'s ``int2basis`` KV (its first KV folder with one)."""
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store

    st = Store.at(store)
    for folder in sorted((store / "kv").glob("kv-*")):
        kv = KvStore.open(st, folder.name)
        if kv.layout.codec.needs_basis:
            return kv.key_basis.read()
    raise SystemExit(f"error: {store} holds no int2basis KV")


def head_dims(model) -> tuple[int, int, int]:
    """(query heads, key-value heads, head dim) of ``model``'s config."""
    cfg = model.config
    n_q = cfg.num_attention_heads
    return n_q, cfg.num_key_value_heads, cfg.hidden_size // n_q


def out_norms(model) -> torch.Tensor:
    """(L, KV heads, D) float32: per layer, key-value head and value channel, the norm of the
    output projection's columns that read it (over the query heads of its group): how much an
    error in value channel ``c`` moves the attention block's output."""
    n_q, n_kv, d = head_dims(model)
    rows = []
    for layer in model.model.layers:
        w = layer.self_attn.o_proj.weight.float()  # (hidden, n_q * D)
        sq = w.square().sum(0).view(n_kv, n_q // n_kv, d).sum(1)
        rows.append(sq.sqrt())
    return torch.stack(rows)


def query_weight_norms(model) -> torch.Tensor:
    """(L, KV heads, D) float32: per layer, key-value head and channel, the pair norm (as
    :func:`query_rms`) of the query projection's rows, the input norm's gain folded in: the
    queries' scale per channel read off the weights, no text needed."""
    n_q, n_kv, d = head_dims(model)
    rows = []
    for layer in model.model.layers:
        w = layer.self_attn.q_proj.weight.float() * layer.input_layernorm.weight.float()
        sq = w.square().sum(1).view(n_kv, n_q // n_kv, d)  # (kv, group, D)
        rows.append((sq + torch.roll(sq, d // 2, -1)).sum(1).sqrt())
    return torch.stack(rows)


def query_rms(model, texts: list[str], tokenizer, max_tokens: int = 1024) -> torch.Tensor:
    """(L, KV heads, D) float32: per layer, key-value head and channel, the RMS over tokens and
    the query heads of its group of the query's pair energy ``q_c**2 + q_c'**2`` (``c'`` the
    channel RoPE rotates ``c`` with, ``rotate_half``: ``c +- D/2``), before RoPE, on ``texts``
    (each cut to ``max_tokens``): how much an error in key channel ``c`` moves ``q . k``."""
    n_q, n_kv, d = head_dims(model)
    sums = torch.zeros(len(model.model.layers), n_kv, d, dtype=torch.float64)
    count = 0
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def hook(_m, _inp, out, i=i):
            q = out[0].float().view(-1, n_kv, n_q // n_kv, d)  # (T, kv, group, D)
            pair = q.square() + torch.roll(q, d // 2, -1).square()
            sums[i] += pair.sum((0, 2)).double()

        hooks.append(layer.self_attn.q_proj.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
                model(input_ids=ids)
                count += ids.shape[1] * (n_q // n_kv)
    finally:
        for h in hooks:
            h.remove()
    return (sums / count).sqrt().float()


def main():
    global BLOCK
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, required=True, help="a bf16 store, codec none")
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=[], help="K/V e.g. int2/had2")
    ap.add_argument("--codec-errors", nargs="+", default=[], help="codecs, e.g. int4 int2mix")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--f1", type=int, default=0, help="answers of the first N questions")
    ap.add_argument("--f1-methods", nargs="+", default=["coinrag"])
    ap.add_argument("--f1-out", type=Path, default=Path("variants-f1"))
    ap.add_argument("--f1-no-reference", action="store_true", help="--f1 without `none`'s run")
    ap.add_argument("--calibrate", type=Path, help="JSONL texts: queries' RMS and axes from them")
    ap.add_argument("--pca", type=int, default=0, help="pca: axes from every N-th entry")
    ap.add_argument("--basis", type=Path, help="stored: the key basis of this store's int2basis KV")
    ap.add_argument("--block", type=int, default=BLOCK, help="tokens per quantized block")
    ap.add_argument(
        "--query-weights", type=Path, help="corpus JSONL: channel weights of kmq/kmw/vmq"
    )
    args = ap.parse_args()
    BLOCK = args.block
    torch.set_num_threads(1)
    from coinrag.inference.context.assemble import KvSlice, assemble_context
    from coinrag.inference.evaluation.evaluate import load_questions
    from coinrag.inference.methods import RagEngine
    from coinrag.inference.methods.assets import StoredKv
    from coinrag.inference.model.encode import document_kv, to_dynamic_cache
    from coinrag.inference.rope import reset_rotary

    engine = RagEngine.open(str(args.store), max_new_tokens=32, methods=("coinrag",))
    model = engine.model
    context = engine.asset(StoredKv)
    float_kv, spec, prefix_kv = context.kv, context.spec, context.prefix_kv
    if float_kv.layout.kv_codec != "none":  # the reference would be a quantized one
        raise SystemExit(
            f"error: {args.store} reads KV by codec {float_kv.layout.kv_codec!r}; point its "
            "coinrag.toml at codec none (bench_kv_table.set_kv_settings(STORE, DTYPE, 'none'))"
        )
    p = engine.prompt.n_prefix
    if args.query_weights:
        global QUERY_RMS, OUT_NORM, QUERY_WEIGHT_NORM
        OUT_NORM = out_norms(model)[None]
        QUERY_WEIGHT_NORM = query_weight_norms(model)[None]
        texts = [json.loads(line)["text"] for line in args.query_weights.open()]
        QUERY_RMS = query_rms(model, texts, engine.prompt.tokenizer)[None]
        print("query RMS per layer (max / min channel):", flush=True)
        print([round((w.max() / w.min()).item(), 1) for w in QUERY_RMS[0]], flush=True)
    if args.calibrate:  # the queries' RMS and the axes from other texts than the store's
        texts = [json.loads(line)["text"] for line in args.calibrate.open()]
        QUERY_RMS = query_rms(model, texts, engine.prompt.tokenizer)[None]
        tok = engine.prompt.tokenizer
        ids = [tok(t, add_special_tokens=False).input_ids[:512] for t in texts]
        calibrate_axes(
            model,
            [keys_to_position_zero(document_kv(model, engine.prompt, i), spec, p) for i in ids],
        )
    elif args.pca:
        calibrate_axes(
            model,
            [
                keys_to_position_zero(float_kv.read_entry(ck), spec, p)
                for ck in list(float_kv.manifest())[:: args.pca]
            ],
        )
    if args.basis:
        global STORED_BASIS
        STORED_BASIS = stored_basis(args.basis)
    if args.codec_errors:
        store_errors(float_kv, spec, p, args.codec_errors)
    readers = {}
    for v in args.variants:
        kk, vv = v.split("/", 1)
        readers[v] = Reader(float_kv, v, spec, p, quantizer(kk, 3), quantizer(vv, 4))
    if args.f1:
        answer_f1(engine, context, readers, args)
    questions = load_questions(args.questions)
    stats = {v: {"kl": [], "top1": [], "kl_first": [], "top1_first": []} for v in readers}
    t0 = time.perf_counter()
    for qi, q in enumerate(questions[: args.limit]):
        retrieval = engine.retriever.two_stage(q.question, kc=4, k=10)
        requests = [(e.content_key, e.tok_start, e.tok_end) for e in retrieval.evidence]
        query_ids = engine.prompt.query_ids(q.question)
        total = p + sum(e - s for _, s, e in requests)
        ref = None
        for name, reader in [("none", None), *readers.items()]:
            if reader is None:
                blocks_ = [float_kv.read_entry(ck)[:, :, :, s:e] for ck, s, e in requests]
                zero = False
            else:
                blocks_ = reader.read_slices(requests)
                zero = True
            slices = [
                KvSlice(b, p + s, p + float_kv.manifest()[ck].tokens, zero)
                for b, (ck, s, _) in zip(blocks_, requests, strict=True)
            ]
            ctx = assemble_context(prefix_kv, slices, spec, new_seq_len=total + len(query_ids))
            reset_rotary(model)
            with torch.inference_mode():
                out = model(
                    input_ids=torch.tensor([query_ids]),
                    past_key_values=to_dynamic_cache(ctx, model.config),
                    position_ids=torch.arange(total, total + len(query_ids))[None],
                )
            lp = torch.log_softmax(out.logits[0].float(), -1)
            if ref is None:
                ref = lp
                continue
            kl = (ref.exp() * (ref - lp)).sum(-1)
            top1 = (lp.argmax(-1) == ref.argmax(-1)).float()
            s = stats[name]
            s["kl"].append(kl.mean().item())
            s["top1"].append(top1.mean().item())
            s["kl_first"].append(kl[-1].item())
            s["top1_first"].append(top1[-1].item())
        if (qi + 1) % 10 == 0:
            print(f"{qi + 1} q ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = {}
    for name, reader in readers.items():
        row = {}
        if reader.errors:
            errs = torch.stack(list(reader.errors.values())).mean(0)
            row["relK"] = round(errs[:, 0].mean().item(), 4)
            row["relV"] = round(errs[:, 1].mean().item(), 4)
            row["relV_layers"] = [round(e, 3) for e in errs[:, 1].tolist()]
        for key, vals in stats[name].items():
            if vals:
                row[key] = round(sum(vals) / len(vals), 4)
        results[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "relV_layers"}), flush=True)
        print("   relV/layer", row.get("relV_layers"), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
