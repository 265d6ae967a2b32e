"""The budget manager and the training loop of a pool of cartridges (CAS section 2).

Only ``B`` cartridges live on the device at a time: their parameter, gradient and Adam moments.
Every other cartridge lives in persistent storage (``storage/cartridges.py``, Zarr, bit-exact) and
its Adam moments in host memory (the "optimizer offload"; on a GPU the device is ``cuda`` and the
host is the CPU). Every ``R`` steps the pool rotates.

Rotation policy (prioritised by need): within an epoch every example is seen once. A cartridge's
need is the number of its examples not yet seen this epoch; the ``B`` most needy cartridges become
resident (ties: the one resident longest ago first, then by id). So cartridges with many pending
examples stay, those that are done leave, and a rotation also happens early when no resident has
a pending example left. Evicted cartridges are written as a new version (``kind="rotation"``) and
their moments are moved to host memory; loaded ones are read from their latest version (or
initialised when they have none).

One step: draw ``batch_size`` examples from the resident cartridges (a cartridge with probability
proportional to its pending examples, then its next example), choose each example's visible
cartridges with :class:`~training.cartridges.Visibility` among the resident pool (the distractor
pool is the resident pool), accumulate the gradients of the mean bucket KL, and step the Adam of
every cartridge that got a gradient (distractors too, unless ``train_distractors`` is off).

Resume: a checkpoint flushes the resident cartridges (``kind="checkpoint"``) and writes one state
file holding the step, the epoch's pending lists, the Python RNG state, every cartridge's latest
stored location and every Adam state. A killed run restarted with the same ``train_key`` reloads
it and produces bit-identical losses from there on (tested). Versions older than the last
checkpoint that it does not reference are pruned after each checkpoint.

Memory (analytic): a cartridge of ``p`` tokens has ``n = layers * 2 * kv_heads * head_dim * p``
values; parameter + gradient + two Adam moments are ``4 n`` values (:func:`train_bytes`).
"""

from __future__ import annotations

import dataclasses
import random
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coinrag.inference.model.encode import prefix_kv
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import ModelRope
from coinrag.schemas.settings import CartridgeTrainSettings
from coinrag.schemas.tables import CartridgeManifestRow
from coinrag.storage.cartridges import CartridgeMeta, CartridgeStore
from coinrag.training.cartridges import (
    Cartridge,
    CartridgeSpec,
    Example,
    Visibility,
    example_loss,
    init_cartridge,
)

STATE_FORMAT = 1

# Instrumentation: every Cartridge the managers put on a device, while it is alive.
LIVE: weakref.WeakSet[Cartridge] = weakref.WeakSet()


class BudgetExceeded(RuntimeError):
    """A load would put more than ``budget`` cartridges on the device."""


def train_bytes(
    p: int, layers: int, kv_heads: int, head_dim: int, param_bytes: int = 4, moment_bytes: int = 4
) -> dict[str, int]:
    """Analytic device bytes of one cartridge in training: parameter, gradient (same dtype) and
    Adam's two moments. E.g. Qwen3-8B (36 layers, 8 KV heads, head dim 128), p = 1024, all bf16:
    4 x 144 MiB = 576 MiB."""
    n = layers * 2 * kv_heads * head_dim * p
    out = {
        "param": n * param_bytes,
        "grad": n * param_bytes,
        "exp_avg": n * moment_bytes,
        "exp_avg_sq": n * moment_bytes,
    }
    out["total"] = sum(out.values())
    return out


def _to_host(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every tensor copied to CPU (the offload)."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, list):
            return [move(v) for v in x]
        return x

    return move(state)


@dataclass
class _Resident:
    cartridge: Cartridge
    optimizer: torch.optim.Optimizer


class BudgetManager:
    """Keeps at most ``budget`` cartridges (parameter + gradient + Adam moments) on ``device``.

    ``metas``: every cartridge of the pool; ``init_fn(cartridge_id)`` makes the initial tensor of
    a cartridge that has no stored version yet; ``config`` gives the budget and Adam's ``lr``,
    ``betas`` and ``eps``. ``peak_resident`` is the largest number ever
    resident (a load beyond the budget raises :class:`BudgetExceeded`).
    """

    def __init__(
        self,
        cstore: CartridgeStore,
        metas: dict[str, CartridgeMeta],
        init_fn: Callable[[str], torch.Tensor],
        config: CartridgeTrainSettings,
        *,
        freeze_first: bool = True,
        device: str = "cpu",
        run_id: str,
    ) -> None:
        if config.budget < 1:
            raise ValueError(f"budget must be >= 1, got {config.budget}")
        self.cstore = cstore
        self.metas = metas
        self.init_fn = init_fn
        self.budget = config.budget
        self.lr, self.betas, self.eps = config.lr, config.betas, config.eps
        self.freeze_first = freeze_first
        self.device = device
        self.run_id = run_id
        self.resident: dict[str, _Resident] = {}  # insertion order = load order
        self.rows: dict[str, CartridgeManifestRow] = {}  # latest stored version per cartridge
        self.host_opt: dict[str, dict[str, Any]] = {}  # offloaded Adam states
        self.peak_resident = 0
        self.peak_bytes: dict[str, int] = {}
        self.loads = 0
        self.evictions = 0

    # ------------------------------------------------------------------ residency

    def tensor(self, cid: str) -> torch.Tensor:
        """The resident parameter of ``cid`` ``(layers, 2, kv_heads, p, head_dim)``."""
        return self.resident[cid].cartridge.kv

    def load(self, cid: str) -> None:
        """Bring ``cid`` to the device (its latest version, or a new one) with its Adam state."""
        if cid in self.resident:
            return
        if len(self.resident) >= self.budget:
            raise BudgetExceeded(
                f"loading {cid} would make {len(self.resident) + 1} resident cartridges "
                f"(budget {self.budget}); evict first"
            )
        row = self.rows.get(cid)
        kv = self.cstore.read(row) if row is not None else self.init_fn(cid)
        cart = Cartridge(self.metas[cid], kv.to(self.device), self.freeze_first)
        opt = torch.optim.Adam([cart.kv], lr=self.lr, betas=self.betas, eps=self.eps)
        saved = self.host_opt.pop(cid, None)
        if saved is not None:
            opt.load_state_dict(saved)
        self.resident[cid] = _Resident(cart, opt)
        LIVE.add(cart)
        self.loads += 1
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def _write(self, cids: Sequence[str], step: int, kind: str) -> None:
        if not cids:
            return
        items = [(self.metas[c], self.tensor(c).detach().to("cpu")) for c in cids]
        for row in self.cstore.write(items, step=step, kind=kind, run_id=self.run_id):
            self.rows[row.cartridge_id] = row

    def evict(self, cids: Sequence[str], step: int) -> None:
        """Write ``cids`` to storage (one version each), offload their moments, drop them."""
        self._write(list(cids), step, "rotation")
        for cid in cids:
            res = self.resident.pop(cid)
            self.host_opt[cid] = _to_host(res.optimizer.state_dict())
            res.cartridge.kv.grad = None
            self.evictions += 1

    def rotate(self, want: Sequence[str], step: int) -> tuple[list[str], list[str]]:
        """Make ``want`` (at most ``budget`` ids) the resident set: evict first, then load.

        Returns ``(evicted, loaded)``.
        """
        if len(want) > self.budget:
            raise BudgetExceeded(f"asked for {len(want)} resident cartridges, budget {self.budget}")
        out = [c for c in self.resident if c not in set(want)]
        self.evict(out, step)
        new = [c for c in want if c not in self.resident]
        for cid in new:
            self.load(cid)
        return out, new

    def flush(self, step: int, kind: str) -> None:
        """Write a version of every resident cartridge (they stay resident)."""
        self._write(list(self.resident), step, kind)

    def store_missing(self, step: int) -> None:
        """Write an ``init`` version of every cartridge that has none (never trained)."""
        for cid in self.metas:
            if cid not in self.rows and cid not in self.resident:
                row = self.cstore.write(
                    [(self.metas[cid], self.init_fn(cid))],
                    step=step,
                    kind="init",
                    run_id=self.run_id,
                )[0]
                self.rows[cid] = row

    def step_optimizers(self) -> int:
        """One Adam step for each resident cartridge with a gradient; returns how many.

        Before stepping, the device bytes of the resident cartridges (with their gradients) are
        measured; ``peak_bytes`` keeps the largest total seen (the state after backward)."""
        now = self.device_bytes()
        if now["total"] > self.peak_bytes.get("total", 0):
            self.peak_bytes = now
        stepped = 0
        for res in self.resident.values():
            if res.cartridge.kv.grad is not None:
                res.optimizer.step()
                stepped += 1
            res.optimizer.zero_grad(set_to_none=True)
        return stepped

    def device_bytes(self) -> dict[str, int]:
        """Bytes held on the device by resident cartridges: parameters, gradients, moments."""
        out = {"param": 0, "grad": 0, "exp_avg": 0, "exp_avg_sq": 0}
        for res in self.resident.values():
            kv = res.cartridge.kv
            out["param"] += kv.nbytes
            out["grad"] += kv.grad.nbytes if kv.grad is not None else 0
            st = res.optimizer.state.get(kv, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name in st:
                    out[name] += st[name].nbytes
        out["total"] = sum(out.values())
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Locations and Adam states of every cartridge (flush the resident ones first)."""
        opt = dict(self.host_opt)
        for cid, res in self.resident.items():
            opt[cid] = _to_host(res.optimizer.state_dict())
        return {
            "rows": {cid: dataclasses.asdict(row) for cid, row in self.rows.items()},
            "opt": opt,
            "resident": list(self.resident),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (the resident set is reloaded from storage)."""
        self.resident.clear()
        self.rows = {cid: CartridgeManifestRow(**row) for cid, row in state["rows"].items()}
        self.host_opt = dict(state["opt"])
        for cid in state["resident"]:
            self.load(cid)


# ---------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class PoolDoc:
    """A document of the pool: its cartridge identity and its token ids."""

    meta: CartridgeMeta
    doc_ids: tuple[int, ...]


@dataclass(frozen=True)
class CartridgePool:
    """The cartridges trained together: where they are stored (``cstore``), one
    :class:`PoolDoc` per cartridge id (``docs``) and their shape (``spec``)."""

    cstore: CartridgeStore
    docs: dict[str, PoolDoc]
    spec: CartridgeSpec


@dataclass(frozen=True)
class TrainRun:
    """One training run of a pool: its ``run_id`` (stored with every version), the
    ``train_key`` naming its checkpoint, and the ``device`` the resident cartridges live on."""

    run_id: str
    train_key: str
    device: str = "cpu"


@dataclass
class TrainReport:
    steps: int = 0
    resumed_from: int | None = None
    losses: list[float] = field(default_factory=list)
    rotations: int = 0
    loads: int = 0
    evictions: int = 0
    peak_resident: int = 0
    epochs: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    final_rows: list[CartridgeManifestRow] = field(default_factory=list)


class CartridgeTrainer:
    """Trains every cartridge of a pool under a device budget, resumable after a kill.

    ``pool``: the cartridges (:class:`CartridgePool`); ``examples``: the distillation set (each
    names its cartridge). ``run.train_key`` names the run's checkpoint: a trainer constructed
    with a key whose checkpoint exists continues from it.
    """

    def __init__(
        self,
        model: Any,
        prompt: RagPrompt,
        rope: ModelRope,
        pool: CartridgePool,
        examples: Sequence[Example],
        config: CartridgeTrainSettings,
        run: TrainRun,
    ) -> None:
        self.model = model.eval()
        for param in model.parameters():
            param.requires_grad_(False)
        self.prompt = prompt
        self.rope = rope
        self.cstore = pool.cstore
        self.docs = pool.docs
        self.examples = list(examples)
        self.spec = pool.spec
        self.config = config
        self.visibility = Visibility.from_settings(config)
        self.train_key = run.train_key
        self.device = run.device
        self.prefix = prefix_kv(model, prompt).to(run.device)
        self.by_cart: dict[str, list[int]] = {cid: [] for cid in pool.docs}
        for i, ex in enumerate(self.examples):
            if ex.cartridge_id not in self.by_cart:
                raise KeyError(f"example {ex.example_id} names unknown cartridge {ex.cartridge_id}")
            self.by_cart[ex.cartridge_id].append(i)
        self.manager = BudgetManager(
            pool.cstore,
            {cid: d.meta for cid, d in pool.docs.items()},
            self.initial,
            config,
            freeze_first=pool.spec.freeze_first,
            device=run.device,
            run_id=run.run_id,
        )
        self.rng = random.Random(config.seed)
        self.pending: dict[str, list[int]] = {cid: [] for cid in pool.docs}
        self.last_resident: dict[str, int] = {}
        self.step = 0
        self.epoch = 0
        self.rotations = 0
        self.losses: list[float] = []
        self._restored_final = False

    def initial(self, cid: str) -> torch.Tensor:
        """The initial value of cartridge ``cid`` (deterministic: seeded by id and seed)."""
        doc = self.docs[cid]
        seed = int(cid.removeprefix("ct-")[:8], 16) ^ self.config.seed
        return init_cartridge(
            self.model, self.prompt, self.rope, doc.doc_ids, doc.meta.p, doc.meta.init, seed=seed
        )

    # ------------------------------------------------------------------ scheduling

    def _new_epoch(self) -> None:
        for cid in sorted(self.by_cart):
            order = list(self.by_cart[cid])
            self.rng.shuffle(order)
            self.pending[cid] = order
        self.epoch += 1

    def _plan(self) -> list[str]:
        """The ``budget`` neediest cartridges (see module doc)."""
        ranked = sorted(
            self.docs,
            key=lambda c: (-len(self.pending[c]), self.last_resident.get(c, -1), c),
        )
        return ranked[: self.config.budget]

    def _rotate(self) -> None:
        want = self._plan()
        self.manager.rotate(want, self.step)
        for cid in self.manager.resident:
            self.last_resident[cid] = self.step
        self.rotations += 1

    def _resident_pending(self) -> list[str]:
        return [c for c in sorted(self.manager.resident) if self.pending[c]]

    def train_step(self) -> float:
        """One optimizer step; returns the mean loss of its examples."""
        if not self.examples:
            raise ValueError("no training examples")
        rotate = self.step % self.config.rotate_every == 0 or not self._resident_pending()
        if not any(self.pending.values()):
            self._new_epoch()
            rotate = True
        if rotate:
            self._rotate()
        pool = sorted(self.manager.resident)
        values: list[float] = []
        for _ in range(self.config.batch_size):
            cands = self._resident_pending()
            if not cands:
                break
            cid = self.rng.choices(cands, weights=[len(self.pending[c]) for c in cands])[0]
            ex = self.examples[self.pending[cid].pop()]
            visible = self.visibility.sample(cid, pool, self.rng)
            tensors = [
                self.manager.tensor(c)
                if (c == cid or self.config.train_distractors)
                else self.manager.tensor(c).detach()
                for c in visible
            ]
            loss = example_loss(self.model, self.prefix, self.rope, tensors, ex)
            (loss / self.config.batch_size).backward()
            values.append(float(loss.detach()))
            del loss, tensors
        self.manager.step_optimizers()
        self.step += 1
        mean = sum(values) / len(values)
        self.losses.append(mean)
        return mean

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, kind: str = "checkpoint") -> None:
        """Flush the resident cartridges and write the state file (atomic), then prune the
        versions it does not reference (older ones; with ``kind="final"``, all of them)."""
        self.manager.flush(self.step, kind)
        state = {
            "final": kind == "final",
            "format": STATE_FORMAT,
            "train_key": self.train_key,
            "step": self.step,
            "epoch": self.epoch,
            "rotations": self.rotations,
            "rng": self.rng.getstate(),
            "pending": {c: list(v) for c, v in self.pending.items()},
            "last_resident": dict(self.last_resident),
            "losses": list(self.losses),
            "manager": self.manager.state_dict(),
        }
        self.cstore.save_state(self.train_key, state)
        keep = {row.location for row in self.manager.rows.values()}
        before = 2**62 if kind == "final" else self.step + 1
        self.cstore.prune(keep, list(self.docs), before_step=before)

    def restore(self) -> bool:
        """Continue from this ``train_key``'s checkpoint, if any; True when restored."""
        state = self.cstore.load_state(self.train_key)
        if state is None:
            return False
        if state.get("format") != STATE_FORMAT or state.get("train_key") != self.train_key:
            raise ValueError(f"checkpoint of {self.train_key} has an unknown format or key")
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.rotations = int(state["rotations"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.pending = {c: list(v) for c, v in state["pending"].items()}
        self.last_resident = dict(state["last_resident"])
        self.losses = list(state["losses"])
        self._restored_final = bool(state.get("final", False))
        self.manager.load_state_dict(state["manager"])
        return True

    def run(
        self,
        max_steps: int,
        *,
        resume: bool = True,
        on_step: Callable[[int, float], None] | None = None,
    ) -> TrainReport:
        """Train until ``max_steps`` optimizer steps in total (counting resumed ones), then
        store the final versions. ``on_step(step, loss)`` is called after every step (tests use
        it to kill the run)."""
        t0 = time.perf_counter()
        report = TrainReport()
        finished = False
        if resume and self.restore():
            report.resumed_from = self.step
            finished = self._restored_final and self.step >= max_steps
        while self.step < max_steps:
            loss = self.train_step()
            every = self.config.checkpoint_every
            if every and self.step % every == 0 and self.step < max_steps:
                self.checkpoint()
            if on_step is not None:
                on_step(self.step, loss)
        if not finished:  # an unchanged rerun of a finished run writes nothing
            self.manager.store_missing(self.step)
            self.checkpoint(kind="final")
        report.final_rows = [self.manager.rows[c] for c in sorted(self.docs)]
        report.steps = self.step
        report.losses = list(self.losses)
        report.rotations = self.rotations
        report.loads = self.manager.loads
        report.evictions = self.manager.evictions
        report.peak_resident = self.manager.peak_resident
        report.epochs = self.epoch
        report.bytes_written = self.cstore.bytes_written
        report.bytes_read = self.cstore.bytes_read
        report.seconds = time.perf_counter() - t0
        return report

    def cartridges(self) -> dict[str, torch.Tensor]:
        """The current value of every cartridge (resident ones from memory), detached, CPU."""
        out = {}
        for cid in self.docs:
            if cid in self.manager.resident:
                out[cid] = self.manager.tensor(cid).detach().to("cpu").clone()
            elif cid in self.manager.rows:
                out[cid] = self.cstore.read(self.manager.rows[cid])
            else:
                out[cid] = self.initial(cid)
        return out
