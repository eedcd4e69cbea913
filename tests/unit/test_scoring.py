"""Score math on synthetic tensors, against a direct full-attention computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from guardrail.probe.scoring import (
    batched_attention_stats,
    focus_of,
    head_attention_stats,
    logistic_focus,
    mean_focus,
    spans_to_mask,
)


def head_focus_scores(q, k, kv_index, instr, data, scale, softcap=None):
    """Focus per head, as the worker derives it from the attention stats."""
    return focus_of(head_attention_stats(q, k, kv_index, instr, data, scale, softcap))


def _reference(q, k, kv_index, instr, data, scale, softcap=None):
    """Plain loop: per head, full softmax row, then the instruction share."""
    out = []
    for h in range(q.shape[0]):
        logits = (k[:, kv_index[h]] @ q[h]) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        a = torch.softmax(logits.double(), 0)
        i, d = a[instr].sum(), a[data].sum()
        out.append((i / (i + d + 1e-8)).item())
    return torch.tensor(out)


def _reference_stats(q, k, kv_index, instr, data, scale):
    """Plain loop in float64: instruction, data and sink mass, largest data token, entropy."""
    out = []
    for h in range(q.shape[0]):
        a = torch.softmax(((k[:, kv_index[h]] @ q[h]) * scale).double(), 0)
        on_data = a[data].tolist()
        total = sum(on_data)
        entropy = -sum(x / total * math.log(x / total) for x in on_data) / math.log(len(on_data))
        out.append([a[instr].sum().item(), total, a[0].item(), max(on_data), entropy])
    return torch.tensor(out, dtype=torch.float64)


def test_head_attention_stats_match_reference_with_gqa():
    g = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim = 41, 4, 2, 8
    q = torch.randn(heads, dim, generator=g) * 2
    k = torch.randn(tokens, kv_heads, dim, generator=g) * 2
    kv_index = torch.arange(heads) // (heads // kv_heads)
    instr, data = spans_to_mask([(1, 12)], tokens), spans_to_mask([(15, 38)], tokens)
    got = head_attention_stats(q, k, kv_index, instr, data, 1 / math.sqrt(dim))
    want = _reference_stats(q, k, kv_index, instr, data, 1 / math.sqrt(dim))
    assert got.shape == (heads, 5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_attention_stats_without_data_are_zero_not_nan():
    q, k = torch.randn(2, 4), torch.randn(6, 1, 4)
    none = spans_to_mask([], 6)
    stats = head_attention_stats(q, k, torch.zeros(2, dtype=torch.long), ~none, none, 0.5)
    assert torch.isfinite(stats).all() and (stats[:, 1:2] == 0).all() and (stats[:, 3:] == 0).all()


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_head_focus_matches_reference_with_gqa(softcap):
    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 57, 6, 2, 16
    q = torch.randn(heads, dim, generator=g) * 3
    k = torch.randn(tokens, kv_heads, dim, generator=g) * 3
    kv_index = torch.arange(heads) // (heads // kv_heads)
    instr = spans_to_mask([(2, 20)], tokens)
    data = spans_to_mask([(25, 50), (52, 55)], tokens)
    got = head_focus_scores(q, k, kv_index, instr, data, 1 / math.sqrt(dim), softcap)
    want = _reference(q, k, kv_index, instr, data, 1 / math.sqrt(dim), softcap)
    assert got.shape == (heads,)
    torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=0)


def test_head_focus_reads_the_right_kv_head():
    # kv head 1 makes every query look at the data; kv head 0 at the instruction.
    k = torch.zeros(4, 2, 2)
    k[0, 0] = torch.tensor([10.0, 0.0])  # instruction token, kv head 0
    k[3, 1] = torch.tensor([10.0, 0.0])  # data token, kv head 1
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    instr, data = spans_to_mask([(0, 1)], 4), spans_to_mask([(3, 4)], 4)
    scores = head_focus_scores(q, k, torch.tensor([0, 1]), instr, data, 1.0)
    assert scores[0] > 0.99 and scores[1] < 0.01


def test_inputs_are_not_mutated():
    q, k = torch.randn(2, 4), torch.randn(5, 1, 4)
    q0, k0 = q.clone(), k.clone()
    head_focus_scores(
        q,
        k,
        torch.tensor([0, 0]),
        spans_to_mask([(0, 2)], 5),
        spans_to_mask([(2, 5)], 5),
        0.5,
        10.0,
    )
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_no_data_span_gives_full_focus():
    q, k = torch.randn(3, 8), torch.randn(10, 1, 8)
    scores = head_focus_scores(
        q,
        k,
        torch.zeros(3, dtype=torch.long),
        spans_to_mask([(0, 4)], 10),
        spans_to_mask([], 10),
        0.3,
    )
    assert torch.allclose(scores, torch.ones(3), atol=1e-6)


def test_aggregations():
    scores = {(1, 0): 0.2, (2, 3): 0.8, (5, 5): 0.5}
    assert mean_focus(scores, [(1, 0), (2, 3)]) == pytest.approx(0.5)
    # logistic: weights predict injection; focus = 1 - sigmoid(z)
    stats = {h: [f, 1 - f, 0.0, 0.0, 0.0] for h, f in scores.items()}
    z = 0.3 + (-4.0 * 0.2) + (1.5 * 0.8)
    want = 1 - 1 / (1 + math.exp(-z))
    table = np.array([stats[(1, 0)], stats[(2, 3)]])
    assert logistic_focus(table, [-4.0, 1.5], 0.3) == pytest.approx(want)
    one = np.array([[1.0, 0.0, 0.0, 0.0, 0.0]])
    assert logistic_focus(one, [-1000.0], 0.0) == pytest.approx(1.0)
    assert logistic_focus(one, [1000.0], 0.0) == pytest.approx(0.0)
    # attention_stats: five weights per head, on log masses and the data entropy
    s = [0.3, 0.2, 0.4, 0.05, 0.7]
    w = [0.5, -1.0, 0.2, 2.0, -3.0]
    z = 0.1 + sum(wi * xi for wi, xi in zip(w, [*map(math.log, s[:4]), s[4]], strict=True))
    got = logistic_focus(np.array([s]), w, 0.1, "attention_stats")
    assert got == pytest.approx(1 - 1 / (1 + math.exp(-z)))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_batched_stats_equal_the_per_request_stats(softcap):
    """Rows of different lengths, padded to the longest, one with no data and one with a single
    data token: each row equals the per-request function on its own unpadded tensors."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 4, 2, 8
    kv_index = torch.arange(heads) // (heads // kv_heads)
    cases = [(41, [(1, 12)], [(15, 38)]), (17, [(0, 5)], []), (30, [(2, 9)], [(20, 21)])]
    width = max(n for n, _, _ in cases)
    q = torch.randn(len(cases), heads, dim, generator=g) * 2
    k = torch.randn(len(cases), width, kv_heads, dim, generator=g) * 2
    valid = torch.zeros(len(cases), width, dtype=torch.bool)
    instr, data = torch.zeros_like(valid), torch.zeros_like(valid)
    for r, (n, i_spans, d_spans) in enumerate(cases):
        valid[r, :n] = True
        instr[r, :n], data[r, :n] = spans_to_mask(i_spans, n), spans_to_mask(d_spans, n)
    got = batched_attention_stats(
        q,
        k.index_select(2, kv_index).transpose(1, 2),
        valid,
        instr,
        data,
        1 / math.sqrt(dim),
        softcap,
    )
    assert got.shape == (len(cases), heads, 5)
    for r, (n, _, _) in enumerate(cases):
        want = head_attention_stats(
            q[r], k[r, :n], kv_index, instr[r, :n], data[r, :n], 1 / math.sqrt(dim), softcap
        )
        torch.testing.assert_close(got[r], want, atol=2e-7, rtol=1e-6)
