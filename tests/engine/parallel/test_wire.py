"""The step message: a follower's builder, fed rank 0's packed step, rebuilds the very
inputs rank 0 built (through buffer growth, row rewrites, padding and fed tokens)."""

from __future__ import annotations

import random

import numpy as np
import torch

from qworker.engine.parallel.wire import BlockOp, Header, decode_ops, encode_op, pack, unpack
from qworker.engine.step_inputs import PreparedStep, StepInput, StepInputBuilder

BS = 4


def _same(a: PreparedStep, b: PreparedStep) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(a.meta, name), getattr(b.meta, name)), name
    for name in ("num_seqs", "num_tokens", "num_decodes", "max_query_len", "max_seq_len",
                 "host_query_start_loc", "host_seq_lens"):
        assert getattr(a.meta, name) == getattr(b.meta, name), name
    assert (a.logits_index is None) == (b.logits_index is None)
    if a.logits_index is not None and b.logits_index is not None:
        assert torch.equal(a.logits_index, b.logits_index)
    assert (a.num_logit_rows, a.graph_size) == (b.num_logit_rows, b.graph_size)


def _ship(leader: StepInputBuilder, follower: StepInputBuilder, step: StepInput,
          prev: torch.Tensor | None = None, pad_to: int | None = None) -> None:
    built = leader.build(step, prev, pad_to=pad_to)
    layout = leader.last_layout
    assert layout is not None and leader.table_log is not None
    ops: list[int] = []
    encode_op(ops, BlockOp.COPY, [(1, 2), (3, 4)])
    n64, n32 = leader.packed()
    header, payload = pack(layout, n64, n32, leader.table_log, ops, 0, np.zeros(8, np.int64))
    leader.table_log.clear()
    header = Header.from_bytes(header.to_bytes())
    got64, got32, runs, got_ops = unpack(header, payload[: header.payload_len].copy())
    assert decode_ops(got_ops) == [(BlockOp.COPY, [(1, 2), (3, 4)])]
    _same(built, follower.load_packed(header.layout, got64, got32, runs, prev))


def test_a_follower_rebuilds_every_step_rank_0_built() -> None:
    cpu = torch.device("cpu")
    leader = StepInputBuilder(cpu, BS, max_tokens=8, max_seqs=2, max_blocks=2)
    leader.table_log = []
    follower = StepInputBuilder(cpu, BS, max_tokens=8, max_seqs=2, max_blocks=2)
    rng = random.Random(0)
    tables = {s: [rng.randrange(100) for _ in range(10)] for s in range(5)}
    done = dict.fromkeys(tables, 0)
    for step_no in range(14):
        chunks, computed, blocks, keys, sample = [], [], [], [], []
        for s in sorted(tables, key=lambda s: (step_no + s) % 3 != 0):
            n = min(1 if done[s] and (step_no + s) % 3 else rng.randint(1, 6), 36 - done[s])
            if n <= 0:
                continue
            if step_no == 7 and s == 2:  # copy-on-write: a new key rewrites the row
                tables[s][0] = 99
            chunks.append([rng.randrange(1000) for _ in range(n)])
            computed.append(done[s])
            blocks.append(tables[s][: -(-(done[s] + n) // BS)])
            keys.append(s + (100 if step_no >= 7 and s == 2 else 0))
            sample.append(rng.choice([0, 1, 2]))
            done[s] += n
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i]) != 1)
        step = StepInput([chunks[i] for i in order], [computed[i] for i in order],
                         [blocks[i] for i in order], [sample[i] for i in order],
                         table_keys=[keys[i] for i in order])
        _ship(leader, follower, step)  # both grow past the tiny starting sizes


def test_padded_decode_steps_and_fed_tokens_arrive_whole() -> None:
    cpu = torch.device("cpu")
    leader = StepInputBuilder(cpu, BS, 16, 8, 4)
    leader.table_log = []
    follower = StepInputBuilder(cpu, BS, 16, 8, 4)
    _ship(leader, follower, StepInput([[5, 6, 7], [8]], [0, 0], [[3], [4]], [1, 1],
                                      table_keys=[1, 2]))
    prev = torch.tensor([41, 42], dtype=torch.int64)  # the previous step's samples
    step = StepInput([[0], [0]], [3, 1], [[3], [4]], [1, 1], table_keys=[1, 2],
                     prev_rows=[1, 0])
    _ship(leader, follower, step, prev, pad_to=4)
    assert follower.last_layout is not None and follower.last_layout.graph_size == 4
