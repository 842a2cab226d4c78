"""Where models are cached (qworker/models/sources.py): configurable, read-only homes, confined,
up to date by ETag/LastModified, shared safely by concurrent loaders.

Regressions: ``s3://`` models could not load under a read-only root filesystem (the
cache went to ``~/.cache`` and raised a raw OSError), and an S3 key such as
``prefix//tmp/x`` was written outside the cache; a model updated in place with a
same-size file kept serving the old weights, and processes sharing one cache raced on
one ``.part`` name (3 of 10 concurrent loads failed). Real S3: moto.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

pytest.importorskip("boto3")

from qworker.errors import ModelLoadError
from qworker.models.sources import confined_path, resolve_source, usable_cache_dir
from tests.fixtures.servers import boto_client


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory nobody here can create files in (a read-only home)."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro-home"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    # root ignores permission bits; sysfs refuses new directories even to root.
    try:
        (Path("/sys") / f"qworker-{uuid.uuid4().hex}").mkdir()
    except OSError:
        return Path("/sys")
    pytest.skip("no directory here is read-only for root")


def _upload(moto_server: str, bucket: str, files: dict[str, bytes]) -> None:
    s3 = boto_client("s3", moto_server)
    for key, body in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)


def test_default_cache_follows_xdg_then_hf_home(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert usable_cache_dir() == tmp_path / "xdg" / "qworker" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert usable_cache_dir() == tmp_path / "hf" / "qworker" / "models"
    assert usable_cache_dir(tmp_path / "mine") == tmp_path / "mine"


def test_an_s3_model_loads_with_a_read_only_home(
    tmp_path: Path, moto_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
    tiny_llama_dir: Path,
) -> None:
    import torch

    from qworker.models.loader import load_model

    home = _read_only_dir(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    _upload(moto_server, s3_bucket, {f"ro/tiny/{f.name}": f.read_bytes()
                                     for f in tiny_llama_dir.iterdir() if f.is_file()})
    loaded = load_model(f"s3://{s3_bucket}/ro/tiny", torch.float32, "cpu",
                        s3_endpoint_url=moto_server)
    assert Path(loaded.source).is_relative_to(tempfile.gettempdir())
    assert (Path(loaded.source) / "config.json").exists()


def test_a_read_only_model_cache_given_explicitly_is_one_clear_error(tmp_path: Path) -> None:
    home = _read_only_dir(tmp_path)
    with pytest.raises(ModelLoadError, match=r"not usable.*QWORKER_MODEL_CACHE") as info:
        resolve_source("s3://bucket/model", cache_dir=home / "cache")
    assert "\n" not in str(info.value)


def test_s3_keys_that_would_leave_the_cache_are_skipped(
    tmp_path: Path, moto_server: str, s3_bucket: str,
) -> None:
    outside = tmp_path / "outside"
    _upload(moto_server, s3_bucket, {
        "m/config.json": b"{}",
        "m/sub/weights.safetensors": b"w",
        f"m/{outside}/escaped.txt": b"x",      # m//tmp/...: an absolute path after the prefix
        "m/../m-escaped.txt": b"x",
        "m/sub/../../up.txt": b"x",
    })
    cache = tmp_path / "cache"
    local = resolve_source(f"s3://{s3_bucket}/m", cache_dir=cache, s3_endpoint_url=moto_server)
    assert local == cache / s3_bucket / "m"
    found = sorted(str(p.relative_to(cache)) for p in cache.rglob("*")
                   if p.is_file() and not p.name.startswith(".qworker-cache"))
    assert found == [f"{s3_bucket}/m/config.json", f"{s3_bucket}/m/sub/weights.safetensors"]
    assert not outside.exists()


def test_confined_path_refuses_absolute_empty_and_parent_parts(tmp_path: Path) -> None:
    assert confined_path(tmp_path, "a/b.json") == tmp_path / "a" / "b.json"
    for bad in ("/etc/passwd", "a//b", "../x", "a/../../x", "./a", "", "a\\..\\b"):
        assert confined_path(tmp_path, bad) is None, bad


def test_a_model_updated_in_place_with_a_same_size_file_is_downloaded_again(
    tmp_path: Path, moto_server: str, s3_bucket: str,
) -> None:
    cache = tmp_path / "cache"
    _upload(moto_server, s3_bucket, {"u/config.json": b'{"v": 1}', "u/w.safetensors": b"AAAA"})
    local = resolve_source(f"s3://{s3_bucket}/u", cache_dir=cache, s3_endpoint_url=moto_server)
    assert (local / "w.safetensors").read_bytes() == b"AAAA"
    first_mtime = (local / "config.json").stat().st_mtime_ns
    _upload(moto_server, s3_bucket, {"u/w.safetensors": b"BBBB"})  # same size, new content
    again = resolve_source(f"s3://{s3_bucket}/u", cache_dir=cache, s3_endpoint_url=moto_server)
    assert again == local and (local / "w.safetensors").read_bytes() == b"BBBB"
    # Unchanged objects are not downloaded again.
    assert (local / "config.json").stat().st_mtime_ns == first_mtime


def test_a_cached_file_changed_locally_is_downloaded_again(
    tmp_path: Path, moto_server: str, s3_bucket: str,
) -> None:
    cache = tmp_path / "cache"
    _upload(moto_server, s3_bucket, {"l/w.safetensors": b"good"})
    local = resolve_source(f"s3://{s3_bucket}/l", cache_dir=cache, s3_endpoint_url=moto_server)
    (local / "w.safetensors").write_bytes(b"evil")  # same size, new mtime
    resolve_source(f"s3://{s3_bucket}/l", cache_dir=cache, s3_endpoint_url=moto_server)
    assert (local / "w.safetensors").read_bytes() == b"good"


def test_many_processes_loading_one_cache_at_once_all_succeed(
    tmp_path: Path, moto_server: str, s3_bucket: str,
) -> None:
    big = os.urandom(2 << 20)  # big enough that the downloads overlap in time
    _upload(moto_server, s3_bucket, {"c/config.json": b"{}", "c/a.safetensors": big,
                                     "c/b.safetensors": big[::-1]})
    cache = tmp_path / "cache"
    code = ("import sys; from pathlib import Path; from qworker.models.sources import "
            "resolve_source; print(resolve_source(sys.argv[1], cache_dir=Path(sys.argv[2]), "
            "s3_endpoint_url=sys.argv[3]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, f"s3://{s3_bucket}/c", str(cache),
                               moto_server], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(4)]
    outcomes = [(p.wait(120), p.stderr.read().decode()[-300:]) for p in procs]  # type: ignore[union-attr]
    assert [rc for rc, _ in outcomes] == [0] * 4, outcomes
    local = cache / s3_bucket / "c"
    assert (local / "a.safetensors").read_bytes() == big
    assert (local / "b.safetensors").read_bytes() == big[::-1]
    assert not [p.name for p in local.iterdir() if ".part" in p.name]
