"""Copying checkpoint tensors into a model's parameters, one tensor at a time.

Models describe how a checkpoint name maps onto their (possibly fused) parameters
with a list of ``(checkpoint_fragment, param_fragment, shard)`` rules; everything
else is copied by exact name. Tensors arrive as an iterator so at most one
checkpoint tensor is held beside the model at any moment. A tensor-parallel slice
(``qworker.models.parallel_layers``) reads only its rows or columns of each tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from qworker.errors import ModelLoadError
from qworker.models.checkpoint_tensor import Readable, read_all
from qworker.models.layers import FusedLinear

# (fragment in the checkpoint name, fragment of the fused module name, shard name)
StackedRule = tuple[str, str, str]


def _sharded(module: object) -> bool:
    """A tensor-parallel slice (``qworker.models.parallel_layers``, or its FP8 form in
    ``qworker.models.quant.fp8_parallel``): it reads its own slice of each tensor."""
    return callable(getattr(module, "load_checkpoint", None))


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Readable]],
    stacked: list[StackedRule],
    skip: tuple[str, ...] = (),
) -> set[str]:
    """Copy every ``(name, tensor)`` into ``model``; return the parameter names filled.

    Tensors are cast to the parameter's dtype and device on copy. A fused shard fills
    its parameter once all of that parameter's shards have arrived. Names that match
    no parameter and no ``skip`` fragment raise ``ModelLoadError``.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    shards_seen: dict[str, set[str]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(fragment in name for fragment in skip):
            continue
        for ckpt_frag, fused_frag, shard in stacked:
            if ckpt_frag not in name:
                continue
            fused_name = name.replace(ckpt_frag, fused_frag)
            module_name, _, kind = fused_name.rpartition(".")
            module = modules.get(module_name)
            if not (isinstance(module, FusedLinear) or _sharded(module)):
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            try:
                if _sharded(module):
                    module.load_checkpoint(shard, kind, tensor)
                else:
                    module.load_shard(shard, kind, read_all(tensor))
            except (KeyError, ValueError) as exc:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from exc
            seen = shards_seen.setdefault(fused_name, set())
            seen.add(shard)
            if len(seen) == len(module.shards):
                loaded.add(fused_name)
            break
        else:
            owner = modules.get(name.rpartition(".")[0])
            if _sharded(owner) and name in params:
                try:
                    owner.load_checkpoint(None, name.rpartition(".")[2], tensor)
                except (KeyError, ValueError) as exc:
                    raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from exc
                loaded.add(name)
                continue
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.data.copy_(read_all(tensor))
            loaded.add(name)
    return loaded


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    """Raise ``ModelLoadError`` naming the parameters no checkpoint tensor filled."""
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors: {shown}")
