"""Known-answer tests of the emulator's warp-level instructions against the PTX ISA.

The expected fragment of every lane is derived from the ISA's tables (PTX ISA 9.7.14.5.8,
mma.m16n8k16 f16/bf16 fragments; 9.7.14.5.15, ldmatrix; 9.7.9.25, cp.async), and a few
lanes are also written out by hand as literals, so a layout mistake made in the emulator
(and copied into a kernel) cannot pass here. The self-test kernels
(``tests/attention/emulator/selftest.cpp``) go through the same helpers of
``cuda/warp_mma.cuh`` the attention kernels use.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qworker.attention.kernel_cache import i32, ptr

CPU = torch.device("cpu")


def _launch(emu_kernels, name: str, args: tuple, smem: int = 0, threads: int = 32) -> None:  # type: ignore[no-untyped-def, type-arg]
    emu_kernels().launch(name, (1, 1, 1), (threads, 1, 1), args, CPU, shared_mem=smem)


# -- ldmatrix ----------------------------------------------------------------------------


def _matrix_image() -> tuple[torch.Tensor, dict[tuple[int, int], int]]:
    """Four 8x8 b16 matrices, element (m, r, c) = 64 m + 8 r + c, each row at a scattered
    16-byte-aligned slot (rows of a matrix need not be contiguous)."""
    slots = np.random.default_rng(0).permutation(32)
    image = torch.zeros(32 * 24, dtype=torch.int16)  # 32 slots of 48 bytes
    where = {}
    for m in range(4):
        for r in range(8):
            slot = int(slots[8 * m + r])
            image[slot * 24 : slot * 24 + 8] = torch.arange(8) + 64 * m + 8 * r
            where[(m, r)] = slot * 48
    return image, where


def _ldmatrix(emu_kernels, n: int, trans: bool, offsets: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    image, _ = _matrix_image()
    out = torch.zeros(32 * 4, dtype=torch.int64)
    off = torch.tensor(offsets, dtype=torch.int32)
    regs = torch.zeros(32 * 4, dtype=torch.int32)
    args = (ptr(image), i32(image.numel() * 2), ptr(off), ptr(regs))
    _launch(emu_kernels, f"qw_test_ldmatrix<{n}, {int(trans)}>", args, smem=image.numel() * 2)
    out = regs.numpy().view(np.uint32).reshape(32, 4)
    return np.stack([out & 0xFFFF, out >> 16], axis=-1)  # [lane, reg, half]


def _row_offsets(n: int) -> list[int]:
    _, where = _matrix_image()
    offs = []
    for lane in range(32):
        m, r = lane // 8, lane % 8
        # lanes past the ones .x1 / .x2 read give a misaligned address: it must be ignored
        offs.append(where[(m, r)] if m < n else 3)
    return offs


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ldmatrix_fragment_matches_the_ptx_table(emu_kernels, n: int) -> None:  # type: ignore[no-untyped-def]
    got = _ldmatrix(emu_kernels, n, False, _row_offsets(n))
    for lane in range(32):
        g, t = lane // 4, lane % 4  # register i: row g, columns 2t and 2t + 1 of matrix i
        for m in range(n):
            assert got[lane, m].tolist() == [64 * m + 8 * g + 2 * t, 64 * m + 8 * g + 2 * t + 1]
    # written out by hand from the ISA's figure
    assert got[0, 0].tolist() == [0, 1]
    assert got[5, 0].tolist() == [10, 11]  # lane 5: row 1, columns 2, 3
    if n == 4:
        assert got[30, 3].tolist() == [252, 253]  # lane 30: row 7, columns 4, 5 of matrix 3


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ldmatrix_trans_fragment_matches_the_ptx_table(emu_kernels, n: int) -> None:  # type: ignore[no-untyped-def]
    got = _ldmatrix(emu_kernels, n, True, _row_offsets(n))
    for lane in range(32):
        g, t = lane // 4, lane % 4  # register i: rows 2t and 2t + 1 of column g
        for m in range(n):
            assert got[lane, m].tolist() == [64 * m + 16 * t + g, 64 * m + 16 * t + 8 + g]
    assert got[0, 0].tolist() == [0, 8]
    assert got[5, 0].tolist() == [17, 25]  # lane 5: rows 2, 3 of column 1
    if n == 4:
        assert got[30, 3].tolist() == [192 + 39, 192 + 47]  # lane 30: rows 4, 5 of column 7


def test_ldmatrix_refuses_a_misaligned_row_address(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    offs = _row_offsets(4)
    offs[3] += 2
    with pytest.raises(RuntimeError, match="failed"):
        _ldmatrix(emu_kernels, 4, False, offs)


# -- mma.sync m16n8k16 -------------------------------------------------------------------


def _pack(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> int:
    bits = torch.stack([lo, hi]).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    return int(bits[0]) | (int(bits[1]) << 16)


def _fragments(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> list[list[int]]:
    """Every lane's A (4) and B (2) registers per the ISA's formulas."""
    frags = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        frags.append([
            _pack(a[g, 2 * t], a[g, 2 * t + 1], dtype),
            _pack(a[g + 8, 2 * t], a[g + 8, 2 * t + 1], dtype),
            _pack(a[g, 2 * t + 8], a[g, 2 * t + 9], dtype),
            _pack(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9], dtype),
            _pack(b[2 * t, g], b[2 * t + 1, g], dtype),
            _pack(b[2 * t + 8, g], b[2 * t + 9, g], dtype),
        ])  # fmt: skip
    return frags


def test_mma_fragment_formulas_match_hand_derived_lanes() -> None:
    # The builder above, pinned to lanes derived by hand from the ISA's figures 79, 81.
    a = torch.arange(256, dtype=torch.float32).view(16, 16)
    b = torch.arange(128, dtype=torch.float32).view(16, 8)
    frags = _fragments(a, b, torch.float16)
    f16 = torch.float16

    def pair(x: float, y: float) -> int:
        return _pack(torch.tensor(x), torch.tensor(y), f16)

    # lane 9: groupID 2, threadID_in_group 1
    assert frags[9] == [
        pair(2 * 16 + 2, 2 * 16 + 3),  # a0, a1: row 2, columns 2, 3
        pair(10 * 16 + 2, 10 * 16 + 3),  # a2, a3: row 10
        pair(2 * 16 + 10, 2 * 16 + 11),  # a4, a5: columns 10, 11
        pair(10 * 16 + 10, 10 * 16 + 11),  # a6, a7
        pair(2 * 8 + 2, 3 * 8 + 2),  # b0, b1: rows 2, 3 of column 2
        pair(10 * 8 + 2, 11 * 8 + 2),  # b2, b3: rows 10, 11
    ]
    # lane 31: groupID 7, threadID_in_group 3
    assert frags[31][0] == pair(7 * 16 + 6, 7 * 16 + 7)
    assert frags[31][3] == pair(15 * 16 + 14, 15 * 16 + 15)
    assert frags[31][5] == pair(14 * 8 + 7, 15 * 8 + 7)


@pytest.mark.parametrize(("mt", "dtype"), [(1, torch.float16), (2, torch.bfloat16)])
def test_mma_computes_d_equals_a_b_plus_c_in_the_ptx_layout(emu_kernels, mt: int, dtype) -> None:  # type: ignore[no-untyped-def]
    # small integers: exact in f16 / bf16 and in the fp32 sums
    a = (torch.arange(256).view(16, 16) * 7 % 11 - 5).float()
    b = (torch.arange(128).view(16, 8) * 5 % 9 - 4).float()
    c = torch.arange(128, dtype=torch.float32).view(16, 8) * 0.5
    frags = (
        torch.tensor(_fragments(a, b, dtype), dtype=torch.int64).to(torch.uint32).view(torch.int32)
    )
    c_in = torch.zeros(32, 4)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c_in[lane] = torch.stack(
            [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
        )
    d = torch.zeros(32, 4)
    _launch(emu_kernels, f"qw_test_mma<{mt}>", (ptr(frags), ptr(c_in), ptr(d)))
    want = a @ b + c
    for lane in range(32):
        g, t = lane // 4, lane % 4  # c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8
        assert d[lane].tolist() == [want[g, 2 * t], want[g, 2 * t + 1], want[g + 8, 2 * t],
                                    want[g + 8, 2 * t + 1]]  # fmt: skip
    assert d[9].tolist() == [want[2, 2], want[2, 3], want[10, 2], want[10, 3]]  # by hand


def test_mma_places_each_one_hot_product_where_the_isa_says(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    for i, k, j in [(0, 0, 0), (3, 9, 5), (12, 15, 7), (8, 1, 2)]:
        a = torch.zeros(16, 16)
        b = torch.zeros(16, 8)
        a[i, k], b[k, j] = 2.0, 3.0
        frags = torch.tensor(_fragments(a, b, torch.bfloat16), dtype=torch.int64)
        frags = frags.to(torch.uint32).view(torch.int32)
        c = torch.zeros(32, 4)
        d = torch.zeros(32, 4)
        _launch(emu_kernels, "qw_test_mma<2>", (ptr(frags), ptr(c), ptr(d)))
        lane = (i % 8) * 4 + j // 2
        slot = (2 if i >= 8 else 0) + j % 2
        assert d[lane, slot] == 6.0 and int((d != 0).sum()) == 1


# -- cp.async ----------------------------------------------------------------------------


def _cp(emu_kernels, mode: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    src = torch.arange(64 * 16, dtype=torch.int64).remainder(251).to(torch.uint8)
    out = torch.zeros(3 * 32 * 16, dtype=torch.uint8)
    _launch(emu_kernels, "qw_test_cp_async", (ptr(src), ptr(out), i32(mode)), smem=64 * 16)
    return out.view(3, 32 * 16), src.view(2, 32 * 16)


def test_cp_async_reads_poison_until_its_wait(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    out, _ = _cp(emu_kernels, 0)
    assert bool((out[0] == 0xFF).all())


def test_cp_async_data_visible_after_wait_group_0(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    out, src = _cp(emu_kernels, 1)
    assert torch.equal(out[0], src[0])


def test_cp_async_wait_group_1_leaves_the_newest_group_in_flight(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    out, src = _cp(emu_kernels, 2)
    assert torch.equal(out[0], src[0])  # the older group is complete
    assert bool((out[1] == 0xFF).all())  # the newest one is not
    assert torch.equal(out[2], src[1])  # until wait_group 0


def test_cp_async_zero_fill_writes_zeros(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    out, _ = _cp(emu_kernels, 3)
    assert bool((out[0] == 0).all())


def test_cp_async_never_waited_fails_the_launch(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="failed"):
        _cp(emu_kernels, 4)


def test_cp_async_uncommitted_copy_is_not_covered_by_a_wait(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    out, src = _cp(emu_kernels, 5)
    assert bool((out[0] == 0xFF).all())
    assert torch.equal(out[1], src[0])


# -- conversions -------------------------------------------------------------------------


def _convert(emu_kernels, x: torch.Tensor, words: torch.Tensor, sel: torch.Tensor):  # type: ignore[no-untyped-def]
    n = x.numel()
    enc = torch.zeros(n, dtype=torch.uint8)
    dec = torch.zeros(n, dtype=torch.int32)
    perm = torch.zeros(n, dtype=torch.int32)
    args = (ptr(x), ptr(enc), ptr(words), ptr(dec), ptr(sel), ptr(perm), i32(n))
    _launch(emu_kernels, "qw_test_convert", args, threads=32)
    return enc, dec, perm


def test_float_to_e4m3_matches_torch_rounding_and_saturation(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    finite = vals[torch.isfinite(vals)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2  # ties: round to the even code
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([
        finite, mids, mids + 1e-4 * mids.abs().clamp_min(1e-3),
        torch.tensor([500.0, -1000.0, 464.0, 1e-12, -0.0, 2.0**-10, 3 * 2.0**-10]),
        torch.randn(2000, generator=gen) * 30, torch.randn(500, generator=gen) * 0.004,
    ]).float()  # fmt: skip
    words = torch.zeros(x.numel(), dtype=torch.int32)
    enc, _, _ = _convert(emu_kernels, x, words, words.clone())
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(enc, want)


def test_e4m3_to_f16_by_bit_moves_is_exact_times_256(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    lo = torch.arange(256, dtype=torch.int64)
    hi = (lo * 37 + 11) % 256
    words = (lo | (hi << 16)).to(torch.int32)
    x = torch.zeros(256)
    _, dec, _ = _convert(emu_kernels, x, words, torch.zeros(256, dtype=torch.int32))
    halves = dec.view(torch.int16).view(256, 2).view(torch.float16).float() * 256
    ref = lambda c: c.to(torch.uint8).view(torch.float8_e4m3fn).float()  # noqa: E731
    for col, codes in ((0, lo), (1, hi)):
        want = ref(codes)
        finite = torch.isfinite(want)
        assert torch.equal(halves[:, col][finite], want[finite])
        assert bool((halves[:, col][~finite].abs() == 480).all())  # NaN codes: never stored


def test_byte_perm_follows_prmt_selectors(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    words = torch.tensor([0x33221100, 0x33221100, 0x33221100, 0x33221100], dtype=torch.int64)
    sel = torch.tensor([0x4140, 0x4342, 0x4240, 0x4341], dtype=torch.int64)
    _, _, perm = _convert(emu_kernels, torch.zeros(4), words.to(torch.int32), sel.to(torch.int32))
    # byte i of the result = byte (sel >> 4i) & 7 of {y = 0xfedcba98 : x}
    assert perm.to(torch.int64).bitwise_and(0xFFFFFFFF).tolist() == [
        0x98119800, 0x98339822, 0x98229800, 0x98339811,
    ]  # fmt: skip
