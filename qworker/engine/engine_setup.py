"""Build an engine's parts from an ``EngineConfig``: device, dtype, model, pool size.

Pool sizing: ``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes (CPU default
1 GiB); else on a GPU, ``gpu_memory_utilization`` x device memory minus the weights,
the activation peak measured by a profiling forward at ``max_num_batched_tokens`` and
the memory the decode CUDA graphs hold (measured by a trial capture). On a GPU the
graphs are captured once the pool is final, unless ``enforce_eager``. With the CUDA
kernels selected, the kernel self-test (``qworker.engine.kernel_selftest``) checks them
against the torch reference before the pool is sized, and one graph replay after capture.
A memory-derived pool is capped at ``2 * max_num_seqs`` full-length sequences. A
pool that cannot hold one ``max_model_len`` sequence is refused with the largest
``max_model_len`` that would fit.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qworker import cpu_kernels
from qworker.attention.fp8 import kv_storage_dtype
from qworker.attention.kernel_cache import KernelRunner
from qworker.attention.paged_attention import describe_layers
from qworker.attention.select import select_backend
from qworker.engine.config import EngineConfig, check_config
from qworker.engine.cuda_graphs import graph_batch_sizes
from qworker.engine.kernel_selftest import SelftestReport, check_graphs, run_selftest
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.model_runner import DEFAULT_CPU_KV_MEMORY, ModelRunner
from qworker.engine.output_processor import OutputProcessor
from qworker.engine.sampler import Sampler
from qworker.engine.scheduler import Scheduler
from qworker.models import cpu_gemm, fused_kernels
from qworker.models.base import ModelSpec
from qworker.models.quant import weight_bytes

if TYPE_CHECKING:
    from qworker.models.loader import LoadedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineParts:
    """Everything an ``Engine`` is made of."""

    tokenizer: Any | None
    spec: ModelSpec
    max_model_len: int
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    sampler: Sampler
    outputs: OutputProcessor
    max_concurrent_full_length_seqs: int
    selftest: SelftestReport
    tp_group: Any = None  # the TensorParallelGroup with tensor_parallel_size > 1


def resolve_device(name: str) -> torch.device:
    """"auto" is CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on a GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_cpu_threads() -> int:
    """torch's intra-op threads on the CPU: the cores this process may use, less one.

    The engine steps on its own thread while the worker's event loop and preparation
    threads parse, tokenize and store results; intra-op threads on every core make each
    parallel op wait for whichever thread the OS parked for that other work (on a
    shared 2-core machine a 9-row decode matmul took 20x longer with 2 threads than
    with 1; docs/benchmarks.md). The packed matmuls share their work instead of
    splitting it up front, so they use every core (``qworker.models.cpu_gemm``).
    """
    return max(1, available_cores() - 1)


@dataclass(slots=True)
class RunnerParts:
    """What every rank builds (``build_runner``): the model and its runner over a pool of
    ``num_blocks`` blocks (plus ``num_swap`` host blocks); ``weight_bytes`` of parameters as
    stored (this rank's shard under tensor parallelism); the kernel self-test's report."""

    loaded: LoadedModel
    runner: ModelRunner
    max_model_len: int
    num_blocks: int
    num_swap: int
    weight_bytes: int
    selftest: SelftestReport


def set_cpu_threads(device: torch.device, cpu_threads: int | None, cores: int) -> None:
    """On the CPU, torch's intra-op threads: ``cpu_threads``, else ``cores`` (this engine's
    or this rank's share) less one, which the worker's event loop and preparation keep."""
    if device.type == "cpu":
        threads = cpu_threads or max(1, cores - 1)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def build_engine_parts(config: EngineConfig, tp_group: Any = None,
                       kernels: KernelRunner | None = None) -> EngineParts:
    """Load the model and tokenizer, size the pool, and wire the engine's parts.

    With ``tensor_parallel_size > 1`` the other ranks are started first (or ``tp_group``,
    a ``qworker.engine.parallel.launcher.TensorParallelGroup``, is used) and build their
    shards beside this one (docs/operations.md, "Tensor parallelism"). ``kernels`` (tests)
    runs the CUDA attention backend through another kernel runner, the CPU emulator of
    ``tests/attention/emulator``, on any device (self-test included).
    """
    from qworker.models.loader import load_tokenizer

    check_config(config)
    group = None
    rank_config = config
    if config.tensor_parallel_size > 1:
        from qworker.engine.parallel.setup import start_ranks

        group, rank_config = start_ranks(config, tp_group)
    try:
        built = build_runner(rank_config, group.rank0 if group is not None else None, kernels)
        if group is not None:
            follower_bytes = group.finish_setup()
            from qworker.engine.parallel.setup import lead

            lead(built, group, follower_bytes)
    except BaseException as exc:
        if group is not None:
            raise group.setup_failed(exc) from exc
        raise
    loaded, runner, max_model_len = built.loaded, built.runner, built.max_model_len
    spec = loaded.spec
    cache = Path(config.model_cache) if config.model_cache else None
    tokenizer = load_tokenizer(config.tokenizer or loaded.source, cache_dir=cache)
    num_blocks, bs = built.num_blocks, config.block_size
    kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, built.num_swap)
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                          config.preemption_mode)
    eos = list(spec.eos_token_ids)
    return EngineParts(
        tokenizer=tokenizer,
        spec=spec,
        max_model_len=max_model_len,
        runner=runner,
        kv=kv,
        scheduler=scheduler,
        sampler=Sampler(runner.device, tokenizer, spec.vocab_size, eos),
        outputs=OutputProcessor(tokenizer, eos, max_model_len),
        max_concurrent_full_length_seqs=num_blocks // -(-max_model_len // bs),
        selftest=built.selftest,
        tp_group=group,
    )


def build_runner(config: EngineConfig, group: Any = None,
                 kernels: KernelRunner | None = None) -> RunnerParts:
    """Load the model (``group``: this rank's shard) and size its pool: the part of the
    setup every tensor-parallel rank runs, side by side (``qworker.engine.parallel``)."""
    from qworker.models.loader import load_model

    started = time.perf_counter()
    world = group.world_size if group is not None else 1
    device = group.device if group is not None else resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    share = max(1, available_cores() // world)  # the cores of one rank
    set_cpu_threads(device, config.cpu_threads, share)
    cache = Path(config.model_cache) if config.model_cache else None
    loaded = load_model(config.model, dtype, device, cache_dir=cache,
                        load_format=config.load_format, quantization=config.quantization,
                        shard=group.shard if group is not None else None)
    spec = loaded.spec
    stored_bytes = weight_bytes(loaded.model)
    logger.info("weights: %.1f MiB as stored (quantization=%s%s)", stored_bytes / 2**20,
                config.quantization, f", rank {group.rank} of {world}" if group else "")
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )
    loaded.model.set_max_model_len(max_model_len)
    backend = select_backend(config.attention_backend, device, kernels)
    # every backend honours per-layer windows and soft-caps (docs/models.md)
    logger.info("attention: %s, all through the %s backend",
                describe_layers(loaded.model), backend.name)
    # the kernel path has the small ops fused too on a GPU; "torch" has not
    fused = fused_kernels.FusedKernels() if device.type == "cuda" and backend.name == "cuda" \
        else None
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, spec.dtype)
    backend, fused, selftest = run_selftest(
        config.kernel_selftest, backend, fused, spec, loaded.model, kv_dtype,
        config.block_size, max_model_len, device)
    if device.type == "cuda":
        fused_kernels.enable(fused)
    elif backend.name == "cpu" and spec.dtype == torch.float32:
        gemm_threads = pack_cpu_linears(loaded.model, config.cpu_threads or share)
        logger.info("CPU threads: %d for torch's ops, %s for the packed matmuls",
                    torch.get_num_threads(), gemm_threads or "none (torch's matmul)")
    loaded_at = time.perf_counter()
    bs = config.block_size
    blocks_per_seq = -(-max_model_len // bs)
    probe_blocks = -(-min(max_model_len, config.max_num_batched_tokens) // bs) + 1
    first_blocks = config.num_kv_blocks or probe_blocks
    runner_args = (loaded.model, spec, device, bs, first_blocks, backend, kv_dtype)
    runner_kwargs: dict[str, Any] = {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": max_model_len}
    if group is not None:
        from qworker.engine.parallel.runner import ParallelModelRunner

        runner: ModelRunner = ParallelModelRunner(*runner_args, group=group, **runner_kwargs)
    else:
        runner = ModelRunner(*runner_args, **runner_kwargs)
    use_graphs = device.type == "cuda" and not config.enforce_eager
    graph_sizes = graph_batch_sizes(config.max_num_seqs)
    if group is not None:
        group.wait_all()  # every rank loaded (unevenly, maybe slowly): collectives from here
    num_blocks = plan_num_blocks(config, runner, max_model_len,
                                 graph_sizes if use_graphs else None)
    if group is not None:  # every rank's pool is the size the smallest can hold
        num_blocks = group.agree_min(num_blocks)
    if config.num_kv_blocks is None:
        # Beyond every running sequence at full length twice over, blocks only serve the
        # prefix cache; millions of them (a tiny model on a big GPU) cost startup time.
        cap = 2 * config.max_num_seqs * blocks_per_seq
        if num_blocks > cap:
            logger.info("KV pool capped at %d blocks (memory allowed %d)", cap, num_blocks)
            num_blocks = cap
    if num_blocks != first_blocks:
        runner.reallocate_pool(num_blocks)
    sized_at = time.perf_counter()
    if use_graphs:
        # After the pool is final: graphs hold its addresses.
        graph_bytes = runner.enable_cuda_graphs(graph_sizes, max_model_len)
        logger.info("CUDA graphs hold %.1f MiB (captured in %.1fs)", graph_bytes / 2**20,
                    runner.graphs.capture_seconds if runner.graphs else 0.0)
        check_graphs(selftest, runner)
    logger.info("startup: model load %.1fs, pool sizing (profiling, kernel compilation, trial "
                "capture) %.1fs, CUDA graph capture %.1fs", loaded_at - started,
                sized_at - loaded_at, time.perf_counter() - sized_at)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV pool holds {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens), "
            f"too few for one max_model_len={max_model_len} sequence; the largest "
            f"max_model_len that fits is {num_blocks * bs} (or give the pool more memory)"
        )
    num_swap = 0
    if config.preemption_mode == "swap":
        num_swap = max(0, config.swap_space // runner.bytes_per_block())
        if group is not None:
            num_swap = group.agree_min(num_swap)
        runner.attach_swap_pool(num_swap)
    logger.info(
        "KV pool: %d blocks of %d tokens (%.1f MiB) on %s; %d sequences of max_model_len=%d "
        "fit; attention backend %s; swap blocks %d",
        num_blocks, bs, num_blocks * runner.bytes_per_block() / 2**20, device,
        num_blocks // blocks_per_seq, max_model_len, selftest.attention_backend or backend.name,
        num_swap,
    )
    return RunnerParts(loaded, runner, max_model_len, num_blocks, num_swap, stored_bytes,
                       selftest)


def pack_cpu_linears(model: torch.nn.Module, threads: int) -> int:
    """The fast CPU path's linear layers: weights packed for ``qworker.models.cpu_gemm``,
    run on ``threads`` threads; returns the threads in use, 0 (weights kept as they are)
    when its kernel cannot be built here."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return 0
    threads = kernels.set_threads(threads)
    started = time.perf_counter()
    packed = cpu_gemm.pack_model(model, kernels)
    logger.info("CPU GEMM: packed %.1f MiB of linear weights in %.1fs", packed / 2**20,
                time.perf_counter() - started)
    return threads


def plan_num_blocks(config: EngineConfig, runner: ModelRunner, max_model_len: int,
                    graph_sizes: list[int] | None = None) -> int:
    """How many blocks the pool gets (see the module docstring). With ``graph_sizes``,
    the memory CUDA graphs of those decode buckets hold is measured by a trial capture
    on the probe pool and left out of the KV budget."""
    per_block = runner.bytes_per_block()
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        return max(0, config.kv_cache_memory // per_block)
    if runner.device.type != "cuda":
        return DEFAULT_CPU_KV_MEMORY // per_block
    dev = runner.device
    peak = runner.profile_peak_bytes(config.max_num_batched_tokens, max_model_len)
    graphs = 0
    if graph_sizes:
        graphs = runner.enable_cuda_graphs(graph_sizes, max_model_len)
        runner.drop_cuda_graphs()
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    in_use = torch.cuda.memory_allocated(dev) - runner.kv_cache.key.nbytes * 2
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
    budget = int(config.gpu_memory_utilization * total) - in_use - peak - non_torch - graphs
    logger.info(
        "GPU memory: total %.1f GiB, weights+other %.2f GiB, activation peak %.2f GiB, "
        "non-torch %.2f GiB, CUDA graphs %.2f GiB -> KV budget %.2f GiB",
        total / 2**30, in_use / 2**30, peak / 2**30, non_torch / 2**30, graphs / 2**30,
        budget / 2**30,
    )
    return max(0, budget // per_block)
