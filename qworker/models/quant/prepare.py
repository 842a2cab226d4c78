"""Loading a model under an FP8 scheme: which layers become FP8, and the weight stream.

``QuantizedLoad`` is made once per load from the scheme, the device and the names of the
checkpoint's FP8 weights (read from the safetensors headers, no data). Before the
weights arrive it swaps the model's eligible linear layers (every ``Linear`` /
``FusedLinear`` of the decoder layers but MoE routers; never the embeddings or the LM
head) on the meta device:

- GPU: a layer whose checkpoint weights are all FP8 (or every eligible layer, quantizing
  on load under ``quantization="fp8"``) becomes an ``Fp8FusedLinear`` / ``Fp8Linear``
  and keeps its weights in FP8: pool sizing then counts the bytes as stored.
- CPU: weights are dequantized on load; layers whose scheme quantizes activations become
  ``ActQuant*Linear`` that emulate it (compressed-tensors and online FP8; fine-grained
  FP8 checkpoints run dequantized, as transformers runs them on a CPU).

``adapt`` then wraps the checkpoint stream: it pairs each FP8 weight with its scale
tensor (buffering whichever comes first), and yields either the FP8 weight with a
canonical ``weight_scale`` (fp32, ``[N]`` per channel or the block grid) or the weight
dequantized to the model dtype; under online FP8 it quantizes dense weights. MoE experts
arrive dense and quantize themselves as they load (``qworker.models.quant.fp8_experts``),
where the GPU has a scaled grouped kernel (else they stay in the model dtype).

Under tensor parallelism the model arrives split (``qworker.models.tp_plan``): its
column- and row-parallel layers become the FP8 forms of ``fp8_parallel``, and the
stream's tensors stay unread (``CheckpointTensor``) so each layer reads its slice of
the weight and of its scales; a weight run dense is dequantized (or, online, quantized)
slice by slice. Split experts quantize their own slices as they load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from qworker.errors import ModelLoadError
from qworker.models.checkpoint_tensor import CheckpointTensor, LazyTensor, read_all
from qworker.models.layers import FusedLinear, Linear
from qworker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from qworker.models.quant.fp8 import (
    FP8,
    dequantize_weight,
    quantize_weight_per_channel,
)
from qworker.models.quant.fp8_linear import (
    ActQuantFusedLinear,
    ActQuantLinear,
    Fp8FusedLinear,
    Fp8Linear,
)
from qworker.models.quant.scheme import ActQuant, Fp8Scheme, WeightScales
from qworker.models.tp_plan import _pattern

logger = logging.getLogger(__name__)

_ROUTERS = (".mlp.gate", ".shared_expert_gate")


def fp8_weight_names(files: list[Path]) -> set[str]:
    """Names of the FP8 tensors in safetensors ``files`` (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                if handle.get_slice(name).get_dtype() in ("F8_E4M3", "F8_E4M3FN"):
                    names.add(name)
    return names


_DENSE = (Linear, FusedLinear, ColumnParallelLinear, RowParallelLinear)


def _eligible(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if type(m) in _DENSE and ".layers." in f".{name}"
            and not name.endswith(_ROUTERS)}


def _lazy(tensor: object) -> bool:
    return isinstance(tensor, CheckpointTensor | LazyTensor)


def _fused_checkpoint(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether the checkpoint ships ``module``'s parts in one tensor under its own name
    (Phi-3's ``qkv_proj`` / ``gate_up_proj``: its tensor-parallel plan says so)."""
    if getattr(module, "fused_checkpoint", False):
        return True
    plan = getattr(type(model), "tp_plan", None) or {}
    return any(rule.fused_checkpoint and _pattern(p).match(name) for p, rule in plan.items())


def checkpoint_names(model: nn.Module, name: str, module: nn.Module) -> list[str]:
    """The checkpoint weight names that fill ``module`` (its fused shards' sources)."""
    shards = getattr(module, "shards", None)
    if not shards or list(shards) == [""] or _fused_checkpoint(model, name, module):
        return [f"{name}.weight"]
    rules = getattr(type(model), "stacked_params", [])
    dotted = f".{name}."
    found = []
    for ckpt_frag, fused_frag, shard in rules:
        if fused_frag in dotted and shard in module.shards:
            found.append(dotted.replace(fused_frag, ckpt_frag)[1:] + "weight")
    return found


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


class QuantizedLoad:
    """One load under ``scheme`` (see the module docstring)."""

    def __init__(self, scheme: Fp8Scheme, device: torch.device, dtype: torch.dtype,
                 fp8_names: set[str], dequantize_only: bool = False) -> None:
        self.scheme = scheme
        self.device = device
        self.dtype = dtype
        self.fp8_names = fp8_names
        self.keep_fp8 = device.type == "cuda" and not dequantize_only
        self.dequantize_only = dequantize_only
        self.kept: set[str] = set()  # checkpoint weight names loaded as FP8
        self.online: set[str] = set()  # checkpoint weight names quantized on load
        self.static_inputs: set[str] = set()  # checkpoint module prefixes with input scales
        self._delivered: set[str] = set()  # kept names that arrived as FP8
        #: FP8 experts on the GPU: None = probe the kernel; tests and byte counts force it.
        self.fp8_experts: bool | None = None

    def prepare(self, model: nn.Module) -> None:
        """Swap the eligible layers of the meta-device ``model`` (see the module docstring)."""
        scheme = self.scheme
        swapped = 0
        for name, module in _eligible(model).items():
            sources = checkpoint_names(model, name, module)
            in_ckpt = bool(sources) and all(s in self.fp8_names for s in sources)
            quantize = scheme.online or in_ckpt
            if not quantize or self.dequantize_only:
                continue
            parallel = isinstance(module, ColumnParallelLinear | RowParallelLinear)
            if parallel:
                self._check_blocks(name, module)
            if parallel and self.keep_fp8:
                new: nn.Module = self._fp8_parallel(module)
                self.kept.update(sources)
            elif parallel and self._emulates_activations():
                new = self._act_quant_parallel(module)
            elif parallel:
                new = module
            elif self.keep_fp8 and self._can_keep(module):
                new = self._fp8_module(module)
                self.kept.update(sources)
            elif not self.keep_fp8 and self._emulates_activations():
                new = self._act_quant_module(module)
            else:
                new = module
            if scheme.online:
                self.online.update(sources)
            if scheme.activations is ActQuant.STATIC_TENSOR and new is not module:
                self.static_inputs.update(s.removesuffix(".weight") for s in sources)
            if new is not module:
                _replace(model, name, new)
                swapped += 1
        experts = 0 if self.dequantize_only else self._prepare_experts(model)
        logger.info("FP8 (%s, %s weights, %s activations): %d layers and %d expert blocks %s",
                    scheme.source, scheme.weights.value, scheme.activations.value, swapped,
                    experts, "kept in FP8" if self.keep_fp8 else "emulated on the CPU")

    def _prepare_experts(self, model: nn.Module) -> int:
        """FP8 experts where the weights are FP8 (or quantized on load) and the device runs
        them: ``Fp8FusedExperts`` on a GPU with the scaled grouped kernel (else the experts
        stay dense), ``ActQuantFusedExperts`` on the CPU under online FP8 only."""
        from qworker.models.moe import FusedExperts
        from qworker.models.quant.fp8_experts import ActQuantFusedExperts, Fp8FusedExperts

        count = 0
        for name, module in list(model.named_modules()):
            if type(module) is not FusedExperts:
                continue
            prefixes = (f"{name}.", f"{name.replace('.mlp.', '.block_sparse_moe.')}.")
            in_ckpt = any(n.startswith(prefixes) for n in self.fp8_names)
            if not (self.scheme.online or in_ckpt):
                continue
            args = (module.num_experts, module.hidden, module.inter, module.act)
            if self.keep_fp8:
                aligned = module.hidden % 16 == 0 and module.inter % 16 == 0
                if not (aligned and self.fp8_experts_supported()):
                    continue
                with torch.device("meta"):
                    new: FusedExperts = Fp8FusedExperts(*args)
            elif self.scheme.online:
                with torch.device("meta"):
                    new = ActQuantFusedExperts(*args).to(self.dtype)
            else:
                continue
            new.inter_range = module.inter_range  # a tensor-parallel rank's slice
            _replace(model, name, new)
            count += 1
        return count

    def fp8_experts_supported(self) -> bool:
        """Whether this device has the grouped FP8 kernel (``fp8_experts`` overrides)."""
        if self.fp8_experts is not None:
            return self.fp8_experts
        from qworker.models.quant.fp8_mm import grouped_kernel

        return self.device.type == "cuda" and self.dtype == torch.bfloat16 and \
            grouped_kernel(self.device) is not None

    def _emulates_activations(self) -> bool:
        return self.scheme.activations is not ActQuant.NONE and self.scheme.source != "fp8"

    def _can_keep(self, module: nn.Module) -> bool:
        if self.scheme.weights is not WeightScales.BLOCK or not isinstance(module, FusedLinear):
            return True
        assert self.scheme.block is not None
        bn = self.scheme.block[0]
        return all(start % bn == 0 for start, _ in module.offsets.values())

    def _check_blocks(self, name: str, module: nn.Module) -> None:
        """Block scales split at block granularity: ``TensorParallelConfigError`` unless
        every rank boundary of ``module`` is a multiple of the block."""
        from qworker.models.quant.fp8_parallel import check_blocks

        if self.scheme.weights is not WeightScales.BLOCK:
            return
        assert self.scheme.block is not None
        if isinstance(module, ColumnParallelLinear):
            check_blocks(name, module.parts, self.scheme.block[0], "output rows",
                         _world(module))
        else:
            assert isinstance(module, RowParallelLinear)
            check_blocks(name, {"": module.cols}, self.scheme.block[1], "input columns",
                         module.shard.world_size)

    def _fp8_parallel(self, module: nn.Module) -> nn.Module:
        from qworker.models.quant.fp8_parallel import (
            Fp8ColumnParallelLinear,
            Fp8RowParallelLinear,
        )

        bias = module.bias is not None
        with torch.device("meta"):
            if isinstance(module, ColumnParallelLinear):
                return Fp8ColumnParallelLinear(module.in_features, module.parts, bias,
                                               module.fused_checkpoint, self.scheme,
                                               self.dtype)
            assert isinstance(module, RowParallelLinear)
            return Fp8RowParallelLinear(module.cols, module.out_features, bias, module.shard,
                                        module.reduce, self.scheme, self.dtype)

    def _act_quant_parallel(self, module: nn.Module) -> nn.Module:
        from qworker.models.quant.fp8_parallel import (
            ActQuantColumnParallelLinear,
            ActQuantRowParallelLinear,
        )

        acts, group, bias = self.scheme.activations, self.scheme.group_size, \
            module.bias is not None
        with torch.device("meta"):
            if isinstance(module, ColumnParallelLinear):
                new: nn.Module = ActQuantColumnParallelLinear(
                    module.in_features, module.parts, bias, module.fused_checkpoint, acts,
                    group)
            else:
                assert isinstance(module, RowParallelLinear)
                new = ActQuantRowParallelLinear(module.cols, module.out_features, bias,
                                                module.shard, module.reduce, acts, group)
        return new.to(self.dtype) if acts is not ActQuant.STATIC_TENSOR else _keep_scale(
            new, self.dtype)

    def _fp8_module(self, module: nn.Module) -> nn.Module:
        with torch.device("meta"):
            if isinstance(module, FusedLinear):
                return Fp8FusedLinear(module.weight.shape[1], module.shards,
                                      module.bias is not None, self.scheme, self.dtype)
            assert isinstance(module, Linear)
            return Fp8Linear(module.in_features, module.out_features, module.bias is not None,
                             self.scheme, self.dtype)

    def _act_quant_module(self, module: nn.Module) -> nn.Module:
        acts, group = self.scheme.activations, self.scheme.group_size
        with torch.device("meta"):
            if isinstance(module, FusedLinear):
                new: nn.Module = ActQuantFusedLinear(module.weight.shape[1], module.shards,
                                                     module.bias is not None, acts, group)
            else:
                assert isinstance(module, Linear)
                new = ActQuantLinear(module.in_features, module.out_features,
                                     module.bias is not None, acts, group)
        return new.to(self.dtype) if acts is not ActQuant.STATIC_TENSOR else _keep_scale(
            new, self.dtype)

    # ---- the weight stream -----------------------------------------------------------

    def adapt(self, weights: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with FP8 weights paired, kept or dequantized, and dense
        weights quantized under online FP8 (see the module docstring)."""
        scale_suffix = "." + self.scheme.scale_name
        waiting_w: dict[str, torch.Tensor] = {}
        waiting_s: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name.endswith(".weight") and tensor.dtype == FP8:
                prefix = name.removesuffix(".weight")
                if prefix in waiting_s:
                    yield from self._paired(prefix, tensor, waiting_s.pop(prefix))
                else:
                    waiting_w[prefix] = tensor
            elif name.endswith(scale_suffix):
                prefix = name.removesuffix(scale_suffix)
                if prefix in waiting_w:
                    yield from self._paired(prefix, waiting_w.pop(prefix), tensor)
                else:
                    waiting_s[prefix] = tensor
            elif name.endswith(".input_scale"):
                if name.removesuffix(".input_scale") in self.static_inputs:
                    yield name, read_all(tensor).to(torch.float32).reshape(1)
            elif name.endswith((".weight_zero_point", ".input_zero_point")):
                if torch.count_nonzero(read_all(tensor)):
                    raise ModelLoadError(f"checkpoint tensor {name!r}: asymmetric FP8 "
                                         "(non-zero zero points) is not supported")
            elif name in self.online:
                yield from self._quantized(name, tensor)
            else:
                yield name, tensor
        missed = sorted(self.kept - self._delivered)
        if missed:  # an FP8 layer would hold a dense weight cast without its scale
            raise ModelLoadError(f"FP8 layers got no FP8 weights under the checkpoint names "
                                 f"{', '.join(missed[:4])}; load with quantization='none'")
        for prefix in waiting_w:
            raise ModelLoadError(f"checkpoint tensor {prefix}.weight is FP8 but the "
                                 f"checkpoint has no {prefix}{scale_suffix}")
        for prefix in waiting_s:
            raise ModelLoadError(f"checkpoint tensor {prefix}{scale_suffix} has no FP8 "
                                 f"{prefix}.weight beside it")

    def _canonical_scale(self, name: str, w8: torch.Tensor, scale: torch.Tensor
                         ) -> torch.Tensor:
        n, k = w8.shape
        s = scale.to(torch.float32)
        if self.scheme.weights is WeightScales.BLOCK:
            assert self.scheme.block is not None
            bn, bk = self.scheme.block
            grid = (-(-n // bn), -(-k // bk))
            if tuple(s.shape) != grid:
                raise ModelLoadError(f"checkpoint tensor {name!r}: block scales of shape "
                                     f"{tuple(s.shape)}, expected {grid} for a {n}x{k} weight "
                                     f"in {bn}x{bk} blocks")
            return s
        if s.numel() == 1:
            return s.reshape(1).expand(n).contiguous()
        if s.numel() == n:
            return s.reshape(n)
        raise ModelLoadError(f"checkpoint tensor {name!r}: {s.numel()} scales for a weight "
                             f"of {n} rows (expected 1 or {n})")

    def _paired(self, prefix: str, w8: torch.Tensor, scale: torch.Tensor
                ) -> Iterator[tuple[str, torch.Tensor]]:
        name = f"{prefix}.weight"
        scales = self._canonical_scale(prefix + "." + self.scheme.scale_name, w8,
                                       read_all(scale))
        if name in self.kept:
            self._delivered.add(name)
            yield name, w8  # a tensor-parallel layer reads its slice of both
            yield f"{prefix}.weight_scale", scales
            return
        block = self.scheme.block if self.scheme.weights is WeightScales.BLOCK else None
        if _lazy(w8):
            from qworker.models.quant.fp8_parallel import DequantizedSlices

            yield name, DequantizedSlices(w8, scales, self.dtype, block)
            return
        yield name, dequantize_weight(w8, scales, self.dtype, block)

    def _quantized(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _lazy(tensor):  # tensor parallelism: each rank quantizes its own slice
            if name in self.kept:
                self._delivered.add(name)
                yield name, tensor  # the FP8 layer quantizes its slice, and under the
                yield name.removesuffix(".weight") + ".weight_scale", tensor  # scale's name
                return
            from qworker.models.quant.fp8_parallel import QuantizedSlices

            yield name, QuantizedSlices(tensor, self.dtype)
            return
        w8, scales = quantize_weight_per_channel(tensor)
        if name in self.kept:
            self._delivered.add(name)
            yield name, w8
            yield name.removesuffix(".weight") + ".weight_scale", scales
        else:
            yield name, dequantize_weight(w8, scales, self.dtype)


def _world(module: ColumnParallelLinear) -> int:
    """The ranks a column-parallel layer's first part is split over."""
    rng = next(iter(module.parts.values()))
    return max(1, rng.total // max(1, rng.size))


def _keep_scale(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` cast to ``dtype`` but for its fp32 ``input_scale``."""
    scale = module.input_scale
    module = module.to(dtype)
    module.input_scale = scale
    return module


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take as stored (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
