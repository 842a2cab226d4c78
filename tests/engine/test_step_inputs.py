"""Step inputs: the persistent buffers give the same inputs a plain computation gives,
the block table is updated incrementally yet never goes stale, buffers grow."""

from __future__ import annotations

import random

import torch

from qworker.engine.step_inputs import StepInput, StepInputBuilder

BS = 4


def _expected(step: StepInput) -> dict[str, list[int]]:
    """Inputs computed the obvious way, token by token."""
    ids, pos, slots, starts, lens = [], [], [], [0], []
    for chunk, done, table in zip(step.token_chunks, step.num_computed, step.block_tables,
                                  strict=True):
        for j, tok in enumerate(chunk):
            p = done + j
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        starts.append(len(ids))
        lens.append(done + len(chunk))
    return {"ids": ids, "pos": pos, "slots": slots, "starts": starts, "lens": lens}


def _check(builder: StepInputBuilder, step: StepInput) -> None:
    prep = builder.build(step)
    want = _expected(step)
    meta = prep.meta
    assert prep.input_ids.tolist() == want["ids"]
    assert prep.positions.tolist() == want["pos"]
    assert meta.slot_mapping.tolist() == want["slots"]
    assert meta.query_start_loc.tolist() == want["starts"] == meta.host_query_start_loc
    assert meta.seq_lens.tolist() == want["lens"] == meta.host_seq_lens
    for row, table in enumerate(step.block_tables):
        assert meta.block_tables[row, : len(table)].tolist() == table
    q_lens = [len(c) for c in step.token_chunks]
    leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    assert meta.num_decodes == leading
    assert meta.max_query_len == max(q_lens) and meta.max_seq_len == max(want["lens"])


def test_mixed_and_decode_steps_match_a_token_by_token_computation() -> None:
    builder = StepInputBuilder(torch.device("cpu"), BS, max_tokens=8, max_seqs=2, max_blocks=2)
    rng = random.Random(0)
    tables = {s: [rng.randrange(100) for _ in range(8)] for s in range(6)}
    done = dict.fromkeys(tables, 0)
    for step_no in range(12):
        chunks, computed, blocks, keys = [], [], [], []
        for s in sorted(tables, key=lambda s: (step_no + s) % 3 != 0):  # vary the order
            n = 1 if done[s] and (step_no + s) % 3 else rng.randint(1, 6)
            n = min(n, 32 - done[s])
            if n <= 0:
                continue
            chunks.append([rng.randrange(1000) for _ in range(n)])
            computed.append(done[s])
            blocks.append(tables[s][: -(-(done[s] + n) // BS)])
            keys.append(s)
            done[s] += n
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i]) != 1)
        step = StepInput([chunks[i] for i in order], [computed[i] for i in order],
                         [blocks[i] for i in order], [True] * len(order),
                         table_keys=[keys[i] for i in order])
        _check(builder, step)  # buffers grow past the tiny starting sizes on the way


def test_a_changed_table_key_rewrites_the_row_and_an_unchanged_one_only_appends() -> None:
    builder = StepInputBuilder(torch.device("cpu"), BS, 16, 4, 8)
    step = StepInput([[5]], [4], [[7, 8]], [1], table_keys=[10])
    assert builder.build(step).meta.block_tables[0, :2].tolist() == [7, 8]
    # same key: the first entries are trusted (append-only), new ones are written
    step = StepInput([[5]], [8], [[7, 8, 9]], [1], table_keys=[10])
    assert builder.build(step).meta.block_tables[0, :3].tolist() == [7, 8, 9]
    # copy-on-write replaced block 8 by 11: the key changes and the row is rewritten
    step = StepInput([[5]], [9], [[7, 11, 9]], [1], table_keys=[12])
    prep = builder.build(step)
    assert prep.meta.block_tables[0, :3].tolist() == [7, 11, 9]
    assert prep.meta.slot_mapping.tolist() == [9 * BS + 1]
    # without keys every row is written in full
    step = StepInput([[5]], [9], [[1, 2, 3]], [1])
    assert builder.build(step).meta.block_tables[0, :3].tolist() == [1, 2, 3]


def test_logits_rows_follow_the_sample_counts() -> None:
    builder = StepInputBuilder(torch.device("cpu"), BS, 16, 4, 8)
    all_decode = StepInput([[1], [2]], [3, 5], [[0], [1, 2]], [True, True])
    prep = builder.build(all_decode)
    assert prep.logits_index is None and prep.num_logit_rows == 2 and prep.is_decode
    mixed = StepInput([[1], [2, 3, 4], [5, 6]], [3, 0, 2], [[0], [1], [2]], [1, 3, 0])
    prep = builder.build(mixed)
    assert prep.logits_index is not None and not prep.is_decode
    assert prep.logits_index.tolist() == [0, 3, 3, 3] and prep.num_logit_rows == 4
    none = builder.build(StepInput([[2, 3]], [0], [[1]], [False]))
    assert none.num_logit_rows == 0


def test_pending_tokens_are_read_from_the_previous_steps_samples() -> None:
    builder = StepInputBuilder(torch.device("cpu"), BS, 16, 4, 8)
    prev = torch.tensor([70, 71, 72])
    step = StepInput([[0], [9], [4, 0]], [5, 2, 0], [[1, 2], [3], [4]], [1, 1, 1],
                     prev_rows=[2, -1, 0])
    assert builder.build(step, prev).input_ids.tolist() == [72, 9, 4, 70]
