"""Where a store lives: a local folder (the default) or an object-storage URL.

``coinrag build SOURCE --store s3://bucket/prefix`` puts every asset of the store in the
bucket: Parquet tables (written through fsspec), the KV Zarr groups (read through Zarr's
``FsspecStore``), the LanceDB index (Lance's own object-store client) and ``coinrag.toml``.

Credentials and the endpoint come from the environment only, exactly as the AWS tools read
them (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``
or ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an
S3-compatible server such as MinIO or Ceph). They never appear in a store URL (one that carries
``user:secret@`` is refused), so the URL can go to tables, logs and lineage as it is.
"""

from __future__ import annotations

import functools
import os
from typing import Any
from urllib.parse import urlsplit

OBJECT_SCHEMES = ("s3",)


class StoreUrlError(ValueError):
    """A store location that coinrag cannot use."""


def split_store_url(text: str) -> tuple[str, str]:
    """``(scheme, path)`` of a store location: ``("", text)`` for a local path (or
    ``file://`` URL), ``("s3", "bucket/prefix")`` for ``s3://bucket/prefix``."""
    if "://" not in text:
        return "", text
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return "", parts.path
    if scheme not in OBJECT_SCHEMES:
        known = ", ".join(f"{s}://" for s in OBJECT_SCHEMES)
        raise StoreUrlError(f"unsupported store URL {text!r}: use a local path or {known}")
    if parts.username or parts.password or "@" in parts.netloc:
        raise StoreUrlError(
            "a store URL must not carry credentials; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the environment instead"
        )
    if parts.query or parts.fragment:
        raise StoreUrlError(f"a store URL takes no query or fragment: {text!r}")
    bucket = parts.netloc
    prefix = parts.path.strip("/")
    if not bucket:
        raise StoreUrlError(f"no bucket in store URL {text!r} (s3://bucket/prefix)")
    return scheme, f"{bucket}/{prefix}" if prefix else bucket


def endpoint_url() -> str | None:
    """The S3 endpoint the environment names (None: AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


@functools.cache
def object_filesystem(scheme: str) -> Any:
    """The fsspec file system of ``scheme`` (s3fs for ``s3``), configured from the environment.

    Listings are not cached: another process (a worker, a concurrent reader) may have written
    since, and a stale listing would hide a shard or a Parquet file.
    """
    if scheme != "s3":
        raise StoreUrlError(f"no object file system for {scheme!r}")
    import s3fs

    return s3fs.S3FileSystem(use_listings_cache=False, endpoint_url=endpoint_url())


def zarr_storage_options(scheme: str) -> dict[str, Any]:
    """Options for Zarr's ``FsspecStore.from_url`` (an asynchronous s3fs underneath)."""
    return {"use_listings_cache": False, "endpoint_url": endpoint_url()}


def lance_storage_options(scheme: str) -> dict[str, str]:
    """Non-secret options for Lance's object-store client: the endpoint, plain HTTP when the
    endpoint is ``http://`` (a local test server), the region. Lance reads the keys from the
    environment itself, so they are not passed (nor kept) here."""
    options: dict[str, str] = {}
    endpoint = endpoint_url()
    if endpoint:
        options["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["aws_region"] = region
    return options
