"""The step plan's device tensors (``guardrail.worker.rows.plan_rows``), without an engine.

The engine tests check the plan end to end (scores equal Hugging Face's with chunked prefill
and prefix caching); here both ways of finding the KV slots, the runner's host block table and
the device's, are checked against slots written out by hand from the block table, on rows of
different lengths, with a row whose spans do not fit failing alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from guardrail.protocol import PROBE_ARG
from guardrail.worker.rows import FLAG_MESSAGES, HostStaging, host_block_table, plan_rows

BLOCK = 4


def _state(key: str, n: int, instruction: list[list[int]], data: list[list[int]]) -> object:
    spec = {"key": key, "instruction": instruction, "data": data, "num_prompt_tokens": n}
    return SimpleNamespace(
        num_prompt_tokens=n, sampling_params=SimpleNamespace(extra_args={PROBE_ARG: spec})
    )


def _case() -> tuple[list[tuple[int, int, object]], np.ndarray]:
    # batch rows 0..3 of a block table of 4 requests x 5 blocks; row 2 is not scored this step
    table = np.array(
        [[7, 3, 9, 0, 0], [1, 2, 0, 0, 0], [5, 6, 8, 4, 0], [11, 10, 12, 13, 14]], dtype=np.int32
    )
    found = [
        (0, 17, _state("a", 10, [[0, 3]], [[3, 9]])),
        (1, 22, _state("b", 6, [[0, 2]], [[2, 5]])),
        (3, 40, _state("bad", 5, [[0, 2]], [[2, 9]])),  # data span past the prompt
        (3, 41, _state("c", 17, [[0, 4]], [[4, 16]])),
    ]
    return found, table


def _by_hand(table: np.ndarray, batch_index: int, width: int) -> list[int]:
    return [int(table[batch_index, p // BLOCK]) * BLOCK + p % BLOCK for p in range(width)]


@pytest.mark.parametrize("host", [True, False], ids=["host-block-table", "device-block-table"])
def test_plan_rows_slots_masks_and_indices(host):
    found, table = _case()
    metadata = SimpleNamespace(block_table=torch.from_numpy(table.copy()))
    rows = plan_rows(found, metadata, BLOCK, set(), "", HostStaging("cpu"), table if host else None)
    assert rows.keys == ["a", "b", "bad", "c"]
    assert rows.ok == [0, 1, 3] and rows.errors[2] is not None and "data span" in rows.errors[2]
    width = 17
    assert rows.slots is not None and rows.slots.shape == (3, width)
    for r, (batch_index, n) in enumerate([(0, 10), (1, 6), (3, 17)]):
        want = _by_hand(table, batch_index, width)
        assert rows.slots[r, :n].tolist() == want[:n]  # beyond a row's prompt: never read
        assert rows.last_slots is not None and int(rows.last_slots[r]) == want[n - 1]
    assert rows.token_rows is not None and rows.token_rows.tolist() == [17, 22, 41]
    assert rows.lengths is not None and rows.lengths.tolist() == [10, 6, 17]
    assert rows.valid is not None and rows.valid.sum(1).tolist() == [10, 6, 17]
    assert rows.instruction is not None and rows.instruction[2].nonzero().flatten().tolist() == [
        0,
        1,
        2,
        3,
    ]
    assert rows.data is not None and rows.data.sum(1).tolist() == [6, 3, 12]
    assert rows.flags is not None and rows.flags.shape == (3, len(FLAG_MESSAGES))
    assert not rows.flags.any()
    rows.flag(0, torch.tensor([False, True, False]))  # flags are writable, per row
    assert rows.flags[:, 0].tolist() == [False, True, False]


def test_host_block_table_is_read_only_from_a_single_kv_cache_group():
    table = np.zeros((2, 3), dtype=np.int32)
    one = SimpleNamespace(block_table=SimpleNamespace(np=table))
    runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=SimpleNamespace()))
    assert host_block_table(runner) is None  # no per-group tables
    runner.input_batch.block_table.block_tables = [one]
    assert host_block_table(runner) is table
    runner.input_batch.block_table.block_tables = [one, one]  # hybrid models: the device's
    assert host_block_table(runner) is None
