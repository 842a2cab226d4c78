"""Where a model lives: turn a model argument into a local path.

Accepted forms: a local directory or ``.gguf`` file, ``s3://bucket/prefix`` (copied
once into a local cache), or a Hugging Face hub id (``org/name``, taken from the local
hub cache first, downloaded otherwise). boto3 and huggingface_hub are imported only in
their branch: the GPU machine has neither need nor, for boto3, the package.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from qworker.errors import ModelLoadError

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def default_cache_dir() -> Path:
    """Where remote models are copied: ``~/.cache/qworker/models``."""
    return Path.home() / ".cache" / "qworker" / "models"


def resolve_source(
    model: str | os.PathLike[str],
    cache_dir: Path | None = None,
    s3_endpoint_url: str | None = None,
) -> Path:
    """The local directory or file holding ``model``; downloads remote models first.

    Raises ``ModelLoadError`` when a local path does not exist or a remote model
    cannot be fetched (for a hub id while offline, the message says so).
    """
    text = os.fspath(model)
    if text.startswith("s3://"):
        return _download_s3(text, cache_dir or default_cache_dir(), s3_endpoint_url)
    path = Path(text).expanduser()
    if path.exists():
        return path
    looks_local = text.startswith(("/", ".", "~")) or text.endswith(".gguf")
    if not looks_local and _HUB_ID.match(text):
        return _download_hub(text, cache_dir)
    raise ModelLoadError(f"model path {text!r} does not exist")


def _download_s3(uri: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise ModelLoadError(f"model URI {uri!r} names no bucket")
    try:
        import boto3
    except ImportError as exc:  # pragma: no cover - only on machines without boto3
        raise ModelLoadError("loading a model from s3:// needs the boto3 package") from exc
    client = boto3.client("s3", endpoint_url=endpoint_url)
    listing_prefix = f"{prefix}/" if prefix else ""
    keys: list[tuple[str, int]] = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=listing_prefix
        )
        for page in pages:
            keys.extend((o["Key"], int(o["Size"])) for o in page.get("Contents", []))
    except Exception as exc:
        raise ModelLoadError(f"cannot list {uri}: {exc}") from exc
    if not keys:
        raise ModelLoadError(f"no objects under {uri}")
    names = [k[len(listing_prefix) :] for k, _ in keys]
    has_safe = any(n.endswith((".safetensors", ".gguf")) for n in names)
    target = cache_dir / bucket / (prefix or "_root")
    for (key, size), rel in zip(keys, names, strict=True):
        if not rel or rel.endswith("/") or ".." in Path(rel).parts:
            continue
        if has_safe and rel.endswith(PICKLE_SUFFIXES):
            continue  # never needed: pickles are not loaded
        dest = target / rel
        if dest.exists() and dest.stat().st_size == size:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        try:
            client.download_file(bucket, key, str(tmp))
        except Exception as exc:
            raise ModelLoadError(f"cannot download s3://{bucket}/{key}: {exc}") from exc
        tmp.replace(dest)
    logger.info("model %s cached in %s", uri, target)
    return target


def _download_hub(repo_id: str, cache_dir: Path | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover
        raise ModelLoadError(
            f"{repo_id!r} is not a local path and huggingface_hub is absent"
        ) from exc
    kwargs = {"allow_patterns": _HUB_PATTERNS, "cache_dir": str(cache_dir) if cache_dir else None}
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except Exception:  # not in the local hub cache: try the network
        pass
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except Exception as exc:
        raise ModelLoadError(
            f"model {repo_id!r} is not a local path and could not be fetched from the "
            f"Hugging Face hub (offline or unknown repository?): {type(exc).__name__}: {exc}"
        ) from exc
