"""The step message rank 0 ships to the other ranks: a small header and one payload.

The header (``Header.to_bytes``: 18 int64) goes down each follower's pipe: it wakes
the follower, however long the engine was idle, and tells it the payload's size. The
payload goes out in one gloo broadcast: the step's packed host buffers as
``StepInputBuilder`` built them (int64 ids, positions, slots, logits rows, feed rows;
int32 query starts and sequence lengths), the block table's writes since the last step,
and the block copies and swaps ordered before it. A follower rebuilds the same
``PreparedStep`` from it (``StepInputBuilder.load_packed``): no per-layer host work and
no second message, except the previous step's sampled ids, broadcast on the device when
the step feeds them (async scheduling: rank 0 does not know them on the host either).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from qworker.engine.step_inputs import StepLayout

_LAYOUT_INTS = len(StepLayout.__slots__)  # type: ignore[attr-defined]
HEADER_INTS = 5 + _LAYOUT_INTS
HEADER_BYTES = 8 * HEADER_INTS


class BlockOp(IntEnum):
    """A block movement replayed on every rank's pool, in rank 0's order."""

    SWAP_OUT = 0
    SWAP_IN = 1
    COPY = 2


@dataclass(slots=True)
class Header:
    """What a follower needs before the payload: sizes, and the step's layout."""

    layout: StepLayout
    n_runs: int  # block-table write values
    n_ops: int  # block-op values
    prev_len: int  # previous step's sampled ids broadcast on the device (0: none)
    payload_len: int  # int64 values in the payload

    def to_bytes(self) -> bytes:
        """The header as it travels (``HEADER_BYTES`` bytes)."""
        ints = [1, *self.layout.as_ints(), self.n_runs, self.n_ops, self.prev_len,
                self.payload_len]
        return np.asarray(ints, dtype=np.int64).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> Header:
        """The inverse of ``to_bytes``."""
        if len(data) != HEADER_BYTES:
            raise ValueError(f"step header of {len(data)} bytes, expected {HEADER_BYTES}")
        ints = np.frombuffer(data, dtype=np.int64).tolist()
        layout = StepLayout.from_ints(ints[1 : 1 + _LAYOUT_INTS])
        n_runs, n_ops, prev_len, payload_len = ints[1 + _LAYOUT_INTS :]
        return cls(layout, n_runs, n_ops, prev_len, payload_len)


def _words32(n32: int) -> int:
    return (n32 + 1) // 2


def pack(layout: StepLayout, n64: np.ndarray, n32: np.ndarray, runs: list[int],
         ops: list[int], prev_len: int, out: np.ndarray) -> tuple[Header, np.ndarray]:
    """The header and the payload (a view of ``out``, grown when too small: use the
    returned array) of one step."""
    w32 = _words32(layout.n32)
    total = layout.n64 + w32 + len(runs) + len(ops)
    if len(out) < total:
        out = np.zeros(max(total, 2 * len(out)), dtype=np.int64)
    at = 0
    out[: layout.n64] = n64
    at = layout.n64
    out[at : at + w32] = 0
    out[at : at + w32].view(np.int32)[: layout.n32] = n32
    at += w32
    out[at : at + len(runs)] = runs
    at += len(runs)
    out[at : at + len(ops)] = ops
    return Header(layout, len(runs), len(ops), prev_len, total), out


def unpack(header: Header, payload: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(int64 values, int32 values, table runs, block ops)`` views of a payload."""
    layout = header.layout
    w32 = _words32(layout.n32)
    at = layout.n64
    n64 = payload[:at]
    n32 = payload[at : at + w32].view(np.int32)[: layout.n32]
    at += w32
    runs = payload[at : at + header.n_runs]
    at += header.n_runs
    return n64, n32, runs, payload[at : at + header.n_ops]


def encode_op(ops: list[int], kind: BlockOp, pairs: list[tuple[int, int]]) -> None:
    """Append one block operation (``(src, dst)`` pairs) to ``ops``."""
    ops.extend((int(kind), len(pairs)))
    ops.extend(p[0] for p in pairs)
    ops.extend(p[1] for p in pairs)


def decode_ops(ops: np.ndarray) -> list[tuple[BlockOp, list[tuple[int, int]]]]:
    """The block operations ``encode_op`` appended, in order."""
    out: list[tuple[BlockOp, list[tuple[int, int]]]] = []
    values = ops.tolist()
    i = 0
    while i < len(values):
        kind, count = BlockOp(values[i]), values[i + 1]
        src, dst = values[i + 2 : i + 2 + count], values[i + 2 + count : i + 2 + 2 * count]
        out.append((kind, list(zip(src, dst, strict=True))))
        i += 2 + 2 * count
    return out
