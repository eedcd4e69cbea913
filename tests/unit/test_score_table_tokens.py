"""A score table's sampled token streams stay with their rows through ``select``, ``merged``
and a save/load round trip."""

from __future__ import annotations

import numpy as np

from guardrail.offline.datasets import ScoreTable


def _table(keys: list[str], counts: list[int], start: float) -> ScoreTable:
    n = len(keys)
    tokens = np.arange(start, start + 3 * sum(counts), dtype=np.float16).reshape(-1, 3)
    return ScoreTable(
        "m",
        [(0, 0)],
        keys,
        np.zeros((n, 1, 5)),
        np.arange(n),
        np.arange(n),
        tokens={4: tokens},
        token_offsets=np.r_[0, np.cumsum(counts)].astype(np.int64),
    )


def test_token_streams_follow_their_rows(tmp_path):
    table = _table(["a", "b", "c"], [2, 0, 3], 0.0)
    picked = table.select([2, 0])
    np.testing.assert_array_equal(picked.row_tokens(4, 0), table.row_tokens(4, 2))
    np.testing.assert_array_equal(picked.row_tokens(4, 1), table.row_tokens(4, 0))
    other = _table(["c", "d"], [1, 4], 100.0)
    merged = table.merged(other)
    assert merged.keys == ["a", "b", "c", "d"]
    assert merged.row_tokens(4, 1).shape == (0, 3)
    np.testing.assert_array_equal(merged.row_tokens(4, 2), table.row_tokens(4, 2))
    np.testing.assert_array_equal(merged.row_tokens(4, 3), other.row_tokens(4, 1))
    table.save(tmp_path / "t.npz")
    loaded = ScoreTable.load(tmp_path / "t.npz")
    for row in range(3):
        np.testing.assert_array_equal(loaded.row_tokens(4, row), table.row_tokens(4, row))


def test_token_index_is_each_rows_own_span():
    table = _table(["a", "b", "c", "d"], [2, 0, 3, 1], 0.0)
    at, counts = table.token_index([2, 1, 0, 3])
    assert counts.tolist() == [3, 0, 2, 1]
    assert at.tolist() == [2, 3, 4, 0, 1, 5]
    at, counts = table.token_index([])
    assert at.dtype == np.int64 and len(at) == 0 and len(counts) == 0
