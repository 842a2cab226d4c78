"""Where a model lives: turn a model argument into a local path.

Accepted forms: a local directory or ``.gguf`` file, ``s3://bucket/prefix`` (copied
once into a local cache), or a Hugging Face hub id (``org/name``, taken from the local
hub cache first, downloaded otherwise). boto3 and huggingface_hub are imported only in
their branch: the GPU machine has neither need nor, for boto3, the package.

The cache directory (docs/configuration.md, ``model_cache``): the one given, else
``$XDG_CACHE_HOME/qworker/models``, ``$HF_HOME/qworker/models`` or
``~/.cache/qworker/models``; when that default cannot be created (a read-only root
filesystem or home) the system temp dir is used instead. A given directory that
cannot be written is a ``ModelLoadError``. Every key copied from S3 lands inside the
cache: keys whose path would leave it (``prefix//etc/x``, ``../``) are refused.

A cached file is up to date when the object's ETag and LastModified are the ones it was
downloaded with and the local file still has the size and mtime it had then (recorded
in ``.qworker-cache.json`` beside the files): a model updated in place in S3 is
downloaded again. Downloads go to a temporary name unique to the process, are renamed
into place atomically, and run under an exclusive lock (``.qworker-cache.lock``), so
any number of processes sharing one cache all load (docs/operations.md, "Model cache").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qworker.errors import ModelLoadError

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
#: Beside the cached files: what each was downloaded from, and the lock of the folder.
CACHE_RECORD = ".qworker-cache.json"
CACHE_LOCK = ".qworker-cache.lock"
_LOCK_LOG_AFTER_S = 2.0


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME`` / ``$HF_HOME`` / ``~/.cache``, then ``qworker/models``."""
    for var in ("XDG_CACHE_HOME", "HF_HOME"):
        value = os.environ.get(var)
        if value:
            return Path(value) / "qworker" / "models"
    return Path.home() / ".cache" / "qworker" / "models"


def usable_cache_dir(cache_dir: Path | str | None = None) -> Path:
    """The cache directory, created; see the module docstring for the fallbacks.

    Raises ``ModelLoadError`` (one line naming the directory) when it cannot be made.
    """
    if cache_dir is not None:
        path = Path(cache_dir).expanduser()
        problem = _make_writable(path)
        if problem is not None:
            raise ModelLoadError(
                f"model cache {path} is not usable ({problem}); set model_cache "
                "(QWORKER_MODEL_CACHE) to a writable directory"
            )
        return path
    first = default_cache_dir()
    problem = _make_writable(first)
    if problem is None:
        return first
    fallback = Path(tempfile.gettempdir()) / f"qworker-{os.getuid()}" / "models"
    again = _make_writable(fallback)
    if again is not None:
        raise ModelLoadError(
            f"no writable model cache: {first} ({problem}), {fallback} ({again}); set "
            "model_cache (QWORKER_MODEL_CACHE) to a writable directory"
        )
    logger.warning("model cache %s is not usable (%s): using %s", first, problem, fallback)
    return fallback


def _make_writable(path: Path) -> str | None:
    """Create ``path`` and check it takes files; the reason when it does not, else None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".qworker-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def confined_path(root: Path, relative: str) -> Path | None:
    """``root / relative`` if that stays inside ``root`` (no absolute, empty or ``..`` part)."""
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") for p in parts) or "\\" in relative:
        return None
    dest = root.joinpath(*parts)
    try:
        dest.resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return dest


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
        return _download_s3(text, usable_cache_dir(cache_dir), s3_endpoint_url)
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
    try:
        client = boto3.client("s3", endpoint_url=endpoint_url)
    except Exception as exc:
        raise ModelLoadError(f"cannot reach S3 for {uri}: {exc}") from exc
    listing_prefix = f"{prefix}/" if prefix else ""
    objects: list[dict[str, Any]] = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=listing_prefix
        )
        for page in pages:
            objects.extend(page.get("Contents", []))
    except Exception as exc:
        raise ModelLoadError(f"cannot list {uri}: {exc}") from exc
    if not objects:
        raise ModelLoadError(f"no objects under {uri}")
    names = [str(o["Key"])[len(listing_prefix):] for o in objects]
    has_safe = any(n.endswith((".safetensors", ".gguf")) for n in names)
    target = confined_path(cache_dir, f"{bucket}/{prefix or '_root'}")
    if target is None:
        raise ModelLoadError(f"model URI {uri!r} does not map to a cache directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create the model cache folder {target}: {exc}") from exc
    with _locked(target):
        record = _read_record(target)
        wanted: dict[str, dict[str, Any]] = {}
        for obj, rel in zip(objects, names, strict=True):
            key = str(obj["Key"])
            if not rel or rel.endswith("/") or rel.startswith(".qworker-cache"):
                continue
            dest = confined_path(target, rel)
            if dest is None:
                logger.warning("skipping s3://%s/%s: its path would leave the model cache",
                               bucket, key)
                continue
            if has_safe and rel.endswith(PICKLE_SUFFIXES):
                continue  # never needed: pickles are not loaded
            remote = {"etag": str(obj.get("ETag", "")),
                      "last_modified": str(obj.get("LastModified", "")),
                      "size": int(obj["Size"])}
            if _up_to_date(dest, record.get(rel), remote):
                wanted[rel] = record[rel]
                continue
            wanted[rel] = _download(client, bucket, key, dest, remote)
            _write_record(target, {**record, **wanted})
        for rel in set(record) - set(wanted):  # files we cached that S3 no longer has
            stale = confined_path(target, rel)
            if stale is not None:
                with contextlib.suppress(OSError):
                    stale.unlink()
        _write_record(target, wanted)
    logger.info("model %s cached in %s", uri, target)
    return target


def _up_to_date(dest: Path, cached: dict[str, Any] | None, remote: dict[str, Any]) -> bool:
    """Same object in S3 (ETag, LastModified) and the same file here (size, mtime)."""
    if cached is None or any(cached.get(k) != v for k, v in remote.items()):
        return False
    try:
        stat = dest.stat()
    except OSError:
        return False
    return stat.st_size == cached.get("size") and stat.st_mtime_ns == cached.get("mtime_ns")


def _download(client: Any, bucket: str, key: str, dest: Path,
              remote: dict[str, Any]) -> dict[str, Any]:
    """Download to a name only this process uses, then rename into place atomically."""
    tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(tmp))
        os.replace(tmp, dest)
        stat = dest.stat()
    except Exception as exc:
        raise ModelLoadError(f"cannot download s3://{bucket}/{key} to {dest}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return {**remote, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the folder's exclusive cache lock (other loaders wait, then find it cached)."""
    try:
        handle = (folder / CACHE_LOCK).open("a")
    except OSError as exc:
        raise ModelLoadError(f"cannot lock the model cache folder {folder}: {exc}") from exc
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is filling the model cache %s: waiting", folder)
            started = time.monotonic()
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            if time.monotonic() - started > _LOCK_LOG_AFTER_S:
                logger.info("model cache %s is free again", folder)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _read_record(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((folder / CACHE_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) \
        else {}


def _write_record(folder: Path, record: dict[str, dict[str, Any]]) -> None:
    tmp = folder / f"{CACHE_RECORD}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, folder / CACHE_RECORD)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the model cache record in {folder}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


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
