"""The CUDA backend against the torch reference.

Two ways in: on the CPU, the real kernel sources built by the emulator
(``tests/attention/emulator``) run behind the backend's own launch code (here the legacy
CUDA-core decode kernel, the cache ops and the dispatch; the tensor-core kernels in
``test_decode_tc.py`` / ``test_prefill_tc.py``); on a GPU (``-m gpu``), the cupy-compiled
kernels run for every dtype, head size, block size, GQA ratio, split-K on and off, partly
filled blocks, contexts up to 32k, the FP8 cache and CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from qworker.attention.backend import KVCache
from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.cuda_kernels import DTYPE_CODE, decode_name, head_tile
from qworker.attention.torch_ref import TorchAttentionBackend
from tests.attention.cases import TOLERANCE, Batch, make_batch, rel_err
from tests.attention.conftest import EMU_LEGACY

REF = TorchAttentionBackend()


def _ref_out(batch: Batch, scale: float) -> torch.Tensor:
    return REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)


def _real_rows(batch: Batch) -> slice:
    return slice(0, int(batch.meta.query_start_loc[-1]))


# ---------------------------------------------------------------------------------------
# CPU: the emulator (fixture emu_lib in tests/attention/conftest.py)


def _emu_backend(lib, **kwargs) -> CudaAttentionBackend:  # type: ignore[no-untyped-def]
    from tests.attention.emulator import EmulatedKernels

    kwargs.setdefault("decode", "legacy")
    return CudaAttentionBackend(kernels=EmulatedKernels(lib), num_sms=4, **kwargs)


EMU_DECODE_CASES = [
    # dtype, head_dim, q_heads, kv_heads, block_size, split, window, seq_lens
    (torch.float32, 32, 8, 1, 8, False, None, [1, 5, 8, 17, 130]),  # MQA, partial blocks
    (torch.bfloat16, 64, 8, 2, 16, True, None, [33, 200, 65]),  # split, GQA 4
    (torch.float16, 80, 4, 2, 32, True, 37, [1, 100, 40]),  # window across partitions
    (torch.bfloat16, 128, 16, 2, 16, False, None, [7, 270]),  # GQA 8, two chunks
    (torch.float32, 96, 3, 3, 16, None, 50, [3, 99]),  # MHA, window, auto split
    (torch.float16, 32, 14, 2, 8, True, None, [9, 70]),  # group 7 (a masked head)
    (torch.float32, 32, 16, 1, 8, True, None, [4, 41]),  # group 16: two head tiles
]


@pytest.mark.parametrize(
    ("dtype", "dim", "q_heads", "kv_heads", "block_size", "split", "window", "lens"),
    EMU_DECODE_CASES,
)
def test_emulated_decode_kernel_matches_reference(  # type: ignore[no-untyped-def]
    emu_lib, dtype, dim, q_heads, kv_heads, block_size, split, window, lens
) -> None:
    assert (DTYPE_CODE[dtype], dim, head_tile(q_heads // kv_heads)) in EMU_LEGACY
    batch = make_batch(
        [1] * len(lens),
        lens,
        q_heads,
        kv_heads,
        dim,
        block_size,
        dtype,
        sliding_window=window,
        seed=len(lens),
    )
    backend = _emu_backend(emu_lib, split_k=split, partition_size=64 if split else None)
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, dim**-0.5)
    assert backend.last_decode is not None
    if split is not None:
        assert backend.last_decode.split == split
    assert rel_err(out, _ref_out(batch, dim**-0.5)) < TOLERANCE[dtype]


def test_emulated_split_and_unsplit_agree_on_a_long_context(emu_lib) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch([1, 1], [600, 257], 8, 2, 64, 16, torch.bfloat16, seed=3)
    outs = []
    for split in (False, True):
        backend = _emu_backend(emu_lib, split_k=split, partition_size=256)
        outs.append(
            backend.forward(
                batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125
            ).float()
        )
    assert rel_err(outs[1], outs[0]) < 1e-2
    assert rel_err(outs[1], _ref_out(batch, 0.125)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("decode", ["legacy", "auto"])
@pytest.mark.parametrize("prefill", ["sdpa", "paged"])
def test_emulated_mixed_batch_matches_reference(emu_lib, prefill: str, decode: str) -> None:  # type: ignore[no-untyped-def]
    # two decodes, a chunk over a cached prefix, a fresh prompt, then padding rows
    batch = make_batch(
        [1, 1, 4, 6], [20, 45, 37, 6], 8, 2, 64, 16, torch.bfloat16, pad_tokens=3, seed=5
    )
    backend = _emu_backend(emu_lib, prefill=prefill, decode=decode)
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    ref = _ref_out(batch, 0.125)
    assert rel_err(out, ref, _real_rows(batch)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    ("dtype", "dim", "q_heads", "kv_heads", "split", "window", "lens"),
    [
        (torch.float32, 32, 8, 1, True, 30, [1, 5, 90]),  # MQA, window across partitions
        (torch.bfloat16, 64, 8, 2, False, None, [33, 200]),
        (torch.float16, 80, 4, 2, None, 9, [100, 40]),
    ],
)
def test_emulated_legacy_decode_soft_cap_matches_reference(  # type: ignore[no-untyped-def]
    emu_lib, dtype, dim, q_heads, kv_heads, split, window, lens
) -> None:
    assert (DTYPE_CODE[dtype], dim, head_tile(q_heads // kv_heads), 1) in EMU_LEGACY
    batch = make_batch([1] * len(lens), lens, q_heads, kv_heads, dim, 16, dtype,
                       sliding_window=window, logits_soft_cap=1.5, seed=dim)
    backend = _emu_backend(emu_lib, split_k=split, partition_size=64 if split else None)
    args = (batch.query, batch.key_cache, batch.value_cache)
    out = backend.forward(*args, batch.meta, 0.4)
    launched = backend._kernels.launches  # type: ignore[attr-defined]
    assert launched[0] == decode_name(dtype, dim, q_heads // kv_heads, capped=True)
    ref = REF.forward(*args, batch.meta, 0.4)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    uncapped = dataclasses.replace(batch.meta, logits_soft_cap=None)
    assert rel_err(REF.forward(*args, uncapped, 0.4), ref) > 0.05


@pytest.mark.parametrize("decode", ["legacy", "auto"])
@pytest.mark.parametrize("prefill", ["sdpa", "paged"])
def test_emulated_mixed_batch_with_window_and_soft_cap_matches_reference(  # type: ignore[no-untyped-def]
    emu_lib, prefill: str, decode: str
) -> None:
    # "legacy": the CUDA-core kernel for decodes (and for each prefill token, "paged");
    # "auto": the tensor-core kernels; "sdpa": the explicit soft-capped form
    dtype = torch.bfloat16
    batch = make_batch([1, 1, 4, 6], [20, 45, 37, 6], 8, 2, 64, 16, dtype, pad_tokens=3,
                       sliding_window=7, logits_soft_cap=2.0, seed=6)
    backend = _emu_backend(emu_lib, prefill=prefill, decode=decode)
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.4)
    ref = _ref_out(batch, 0.4)
    assert rel_err(out, ref, _real_rows(batch)) < TOLERANCE[dtype]


def test_emulated_write_kv_matches_reference_and_skips_padding(emu_lib) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch([1, 3, 2], [9, 20, 2], 4, 2, 32, 8, torch.float16, pad_tokens=2, seed=7)
    backend = _emu_backend(emu_lib)
    # aligned rows (16-byte path), then rows sliced out of a fused projection at an odd
    # element offset (2-byte path)
    n = batch.meta.num_tokens
    fused = torch.randn(n, 1 + 2 * 2 * 32, dtype=torch.float16)
    odd_k = fused[:, 1 : 1 + 64].view(n, 2, 32)
    odd_v = fused[:, 1 + 64 :].view(n, 2, 32)
    for key, value in ((batch.new_key, batch.new_value), (odd_k, odd_v)):
        got_k, got_v = batch.key_cache.clone(), batch.value_cache.clone()
        want_k, want_v = batch.key_cache.clone(), batch.value_cache.clone()
        backend.write_kv(key, value, got_k, got_v, batch.meta.slot_mapping)
        REF.write_kv(key, value, want_k, want_v, batch.meta.slot_mapping)
        assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))


def test_emulated_copy_blocks_matches_reference(emu_lib) -> None:  # type: ignore[no-untyped-def]
    pool = KVCache.allocate(3, 10, 2, 8, 32, torch.bfloat16, "cpu")
    pool.key.normal_()
    pool.value.normal_()
    want = KVCache(pool.key.clone(), pool.value.clone())
    src, dst = torch.tensor([1, 4, 7]), torch.tensor([9, 0, 2])
    _emu_backend(emu_lib).copy_blocks(pool, src, dst)
    REF.copy_blocks(want, src, dst)
    assert torch.equal(pool.key, want.key)
    assert torch.equal(pool.value, want.value)


def test_backend_imports_and_falls_back_to_torch_without_cuda() -> None:
    batch = make_batch([1, 3], [5, 9], 4, 2, 32, 8, torch.float32)
    backend = CudaAttentionBackend()
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.2)
    assert rel_err(out, _ref_out(batch, 0.2), _real_rows(batch)) < 1e-6
    with pytest.raises(ValueError, match="prefill"):
        CudaAttentionBackend(prefill="bogus")
    with pytest.raises(ValueError, match="decode"):
        CudaAttentionBackend(decode="bogus")


# ---------------------------------------------------------------------------------------
# GPU

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GPU_HEAD_SIZES = [64, 80, 96, 128, 256]
GQA_SHAPES = [(8, 8), (8, 4), (8, 2), (8, 1), (14, 2), (32, 1)]  # ratios 1, 2, 4, 8, 7, MQA 32


def _gpu_lens(rng: random.Random, block_size: int, n: int) -> list[int]:
    lens = [1, block_size, block_size + 1, 3 * block_size - 1]  # partly filled last blocks
    lens += [rng.randint(2, 1500) for _ in range(max(0, n - len(lens)))]
    return lens[:n]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dim"), list(itertools.product(GPU_DTYPES, GPU_HEAD_SIZES)))
def test_gpu_decode_matches_reference(dtype: torch.dtype, dim: int) -> None:
    rng = random.Random(dim)
    failures = []
    for (q_heads, kv_heads), block_size, split in itertools.product(
        GQA_SHAPES, (8, 16, 32), (False, True)
    ):
        window = rng.choice([None, None, 100])
        lens = _gpu_lens(rng, block_size, 7)
        batch = make_batch(
            [1] * len(lens),
            lens,
            q_heads,
            kv_heads,
            dim,
            block_size,
            dtype,
            "cuda",
            sliding_window=window,
            seed=rng.randint(0, 1 << 30),
        )
        backend = CudaAttentionBackend(split_k=split, partition_size=rng.choice([64, 256, 512]))
        out = backend.forward(
            batch.query, batch.key_cache, batch.value_cache, batch.meta, dim**-0.5
        )
        err = rel_err(out, _ref_out(batch, dim**-0.5))
        if not err < TOLERANCE[dtype]:
            failures.append((q_heads, kv_heads, block_size, split, window, lens, err))
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long_contexts_up_to_32k_split_automatically(dtype: torch.dtype) -> None:
    lens = [32768, 32000 + 3, 1, 4097]
    batch = make_batch([1] * 4, lens, 32, 8, 128, 16, dtype, "cuda", seed=11)
    ref = _ref_out(batch, 128**-0.5)
    auto = CudaAttentionBackend()
    out = auto.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 128**-0.5)
    assert auto.last_decode is not None and auto.last_decode.split
    assert rel_err(out, ref) < TOLERANCE[dtype]
    whole = CudaAttentionBackend(split_k=False)
    out = whole.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 128**-0.5)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("prefill", ["sdpa", "paged"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_mixed_batch_with_prefix_hits_matches_reference(
    prefill: str, dtype: torch.dtype
) -> None:
    for q_heads, kv_heads in ((32, 8), (8, 8), (16, 1)):
        batch = make_batch(
            [1, 1, 1, 37, 300, 5],
            [1, 700, 33, 500, 300, 4000],
            q_heads,
            kv_heads,
            128,
            16,
            dtype,
            "cuda",
            pad_tokens=5,
            seed=q_heads,
        )
        backend = CudaAttentionBackend(prefill=prefill)
        out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.09)
        err = rel_err(out, _ref_out(batch, 0.09), _real_rows(batch))
        assert err < TOLERANCE[dtype], (q_heads, kv_heads, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_write_kv_is_byte_exact_and_skips_padding(dtype: torch.dtype) -> None:
    batch = make_batch([1, 7, 30], [40, 7, 64], 8, 4, 128, 16, dtype, "cuda", pad_tokens=4)
    n = batch.meta.num_tokens
    fused = torch.randn(n, 1 + 2 * 4 * 128, device="cuda").to(dtype)
    views = [
        (batch.new_key, batch.new_value),
        (fused[:, 1 : 1 + 512].view(n, 4, 128), fused[:, 1 + 512 :].view(n, 4, 128)),
    ]
    backend = CudaAttentionBackend()
    for key, value in views:
        got_k, got_v = batch.key_cache.clone(), batch.value_cache.clone()
        want_k, want_v = batch.key_cache.clone(), batch.value_cache.clone()
        backend.write_kv(key, value, got_k, got_v, batch.meta.slot_mapping)
        REF.write_kv(key, value, want_k, want_v, batch.meta.slot_mapping)
        torch.cuda.synchronize()
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_copy_blocks_and_swap_round_trip_match_reference() -> None:
    backend = CudaAttentionBackend()
    pool = KVCache.allocate(4, 64, 8, 16, 128, torch.bfloat16, "cuda")
    pool.key.normal_()
    pool.value.normal_()
    want = KVCache(pool.key.clone(), pool.value.clone())
    src, dst = (
        torch.tensor([1, 5, 9, 33], device="cuda"),
        torch.tensor([2, 60, 0, 34], device="cuda"),
    )
    backend.copy_blocks(pool, src, dst)
    REF.copy_blocks(want, src, dst)
    assert torch.equal(pool.key, want.key) and torch.equal(pool.value, want.value)

    host = KVCache.allocate(4, 16, 8, 16, 128, torch.bfloat16, "cpu", pin_memory=True)
    out_src, out_dst = torch.tensor([3, 60, 7]), torch.tensor([15, 0, 4])
    backend.swap_blocks(pool, host, out_src, out_dst)
    for i, j in zip(out_src.tolist(), out_dst.tolist(), strict=True):
        assert torch.equal(host.key[:, j], pool.key[:, i].cpu())
        assert torch.equal(host.value[:, j], pool.value[:, i].cpu())
    back = KVCache.allocate(4, 64, 8, 16, 128, torch.bfloat16, "cuda")
    backend.swap_blocks(host, back, out_dst, out_src)
    torch.cuda.synchronize()
    for i in out_src.tolist():
        assert torch.equal(back.key[:, i], pool.key[:, i])
        assert torch.equal(back.value[:, i], pool.value[:, i])


@pytest.mark.gpu
def test_gpu_kernels_run_on_torch_current_stream() -> None:
    batch = make_batch([1] * 8, [3000] * 8, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=2)
    ref = _ref_out(batch, 0.1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # the cache is rebuilt on the side stream right before the kernel reads it
        key = batch.key_cache.clone()
        value = batch.value_cache.clone()
        out = CudaAttentionBackend().forward(batch.query, key, value, batch.meta, 0.1)
    stream.synchronize()
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gpu_engine_greedy_tokens_match_the_torch_backend(tmp_path, kv_heads: int) -> None:  # type: ignore[no-untyped-def]
    # The whole engine on the GPU in fp32: chunked prefill (small token budget), prefix
    # hits (shared prompt heads) and decodes through the CUDA backend give the torch
    # backend's greedy tokens.
    from qworker.engine.llm import LLM
    from qworker.engine.sampling_params import SamplingParams
    from tests.fixtures.models import make_tiny_model_dir

    model = make_tiny_model_dir("llama", tmp_path / "m", head_dim=64, num_key_value_heads=kv_heads)
    rng = random.Random(kv_heads)
    head = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [head + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 77)]
    prompts += [[rng.randrange(3, 500) for _ in range(n)] for n in (2, 17, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cuda"):
        llm = LLM(
            str(model),
            dtype="float32",
            device="cuda",
            attention_backend=backend,
            block_size=16,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            num_kv_blocks=512,
        )
        assert llm.stats().get("attention_backend", backend) == backend
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    same = sum(a == b for x, y in zip(tokens["torch"], tokens["cuda"], strict=True)
               for a, b in zip(x, y, strict=True))  # fmt: skip
    total = sum(len(x) for x in tokens["torch"])
    assert [x[:8] for x in tokens["cuda"]] == [x[:8] for x in tokens["torch"]]
    assert same >= 0.95 * total, (same, total)


@pytest.mark.gpu
@pytest.mark.parametrize("prefill", ["paged", "sdpa"])
@pytest.mark.parametrize(
    ("dtype", "kv8"), [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)],
)
def test_gpu_soft_capped_windowed_layers_match_reference(dtype: torch.dtype, kv8: bool,
                                                         prefill: str) -> None:
    # Gemma 2's layers on the hardware: the CAP=1 instantiations of every kernel (fp32: the
    # legacy one), windows on and off, decodes with splits, prefill chunks over prefixes.
    from tests.attention.test_decode_tc import fp8_batch

    failures = []
    # (two head sizes, group 2: few kernels to compile on first use)
    for dim, (q_heads, kv_heads), window, cap in ((128, (16, 8), 700, 2.0),
                                                  (256, (8, 4), None, 30.0)):
        batch = make_batch([1, 1, 1, 37, 300, 5], [1, 900, 3000, 500, 300, 2000], q_heads,
                           kv_heads, dim, 16, dtype, "cuda", sliding_window=window,
                           logits_soft_cap=cap, pad_tokens=3, seed=dim + q_heads)
        scales = None
        if kv8:
            batch, scales = fp8_batch(batch)
        backend = CudaAttentionBackend(prefill=prefill)
        args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.3)
        out = backend.forward(*args, kv_scales=scales)
        err = rel_err(out, REF.forward(*args, kv_scales=scales), _real_rows(batch))
        if not err < TOLERANCE[dtype] * (2 if dtype == torch.float32 else 1):
            failures.append((dim, q_heads, kv_heads, window, cap, err))
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_gemma2_engine_greedy_tokens_match_the_torch_backend(tmp_path, dtype: str) -> None:  # type: ignore[no-untyped-def]
    # Soft-capped, alternating windowed / global layers through the whole engine on the GPU
    # (CUDA graphs on for the decodes), against the torch backend on the same GPU.
    from qworker.engine.llm import LLM
    from qworker.engine.sampling_params import SamplingParams
    from tests.fixtures.models import make_tiny_model_dir

    model = make_tiny_model_dir("gemma2", tmp_path / "m", head_dim=64, hidden_size=128,
                                sliding_window=24)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 77, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cuda"):
        llm = LLM(str(model), dtype=dtype, device="cuda", attention_backend=backend,
                  block_size=16, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=256,
                  max_model_len=512)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    same = sum(a == b for x, y in zip(tokens["torch"], tokens["cuda"], strict=True)
               for a, b in zip(x, y, strict=True))  # fmt: skip
    total = sum(len(x) for x in tokens["torch"])
    assert [x[:4] for x in tokens["cuda"]] == [x[:4] for x in tokens["torch"]]
    assert same >= (0.95 if dtype == "float32" else 0.8) * total, (same, total)
