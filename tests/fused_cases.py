"""Paged-cache cases for the fused probe kernel and the PyTorch path it replaces (unit tests
under Triton's interpreter, GPU tests compiled)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from guardrail.probe import fused_stats
from guardrail.probe.kv_layout import flash_attn_key_view, flash_attn_keys
from guardrail.probe.scoring import batched_logits, stats_from_logits
from guardrail.worker.rows import FLAG_MESSAGES, StepRows

CASES = {
    # lengths, (instruction spans, data spans) per row
    "mixed lengths over several blocks": (
        [37, 150, 5],
        [([(0, 10)], [(12, 30)]), ([(0, 40), (140, 150)], [(41, 139)]), ([(0, 2)], [(2, 4)])],
    ),
    "a row without data, a row with one data token": (
        [20, 70],
        [([(1, 19)], []), ([(0, 30)], [(69, 70)])],
    ),
    "the data at the start (sink inside the data)": ([64, 65], [([(40, 64)], [(0, 40)])] * 2),
}


def paged_case(
    lengths, spans, *, heads=(0, 5, 6, 7), q_heads=8, kv=2, dim=16, block=16, seed=0, device="cpu"
):
    """A paged cache holding each row's keys in shuffled blocks, the step's queries, and the
    masks and slots the probe builds for those rows."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    per_row = [-(-n // block) for n in lengths]
    num_blocks = sum(per_row) + 3
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.randn(num_blocks, kv, block, 2 * dim, generator=gen)  # logical layout
    rows = len(lengths)
    slots = torch.zeros(rows, width, dtype=torch.long)
    at = 0
    for r, n in enumerate(lengths):
        blocks = order[at : at + per_row[r]]
        at += per_row[r]
        positions = torch.arange(n)
        slots[r, :n] = blocks[positions // block] * block + positions % block
    query = torch.randn(rows * 3, q_heads, dim, generator=gen) * 2.0
    token_rows = torch.arange(rows) * 3 + 1
    valid = torch.zeros(rows, width, dtype=torch.bool)
    instruction = torch.zeros_like(valid)
    data = torch.zeros_like(valid)
    for r, (n, (ins, dat)) in enumerate(zip(lengths, spans, strict=True)):
        valid[r, :n] = True
        for a, b in ins:
            instruction[r, a:b] = True
        for a, b in dat:
            data[r, a:b] = True
    local = torch.tensor(heads)
    kv_heads = local // (q_heads // kv)
    case = (cache, query, token_rows, local, kv_heads, slots, valid, instruction, data)
    return tuple(t.to(device) for t in case)


def torch_path(cache, query, token_rows, local, kv_heads, slots, valid, instruction, data, **kw):
    q = query[token_rows[:, None], local]
    keys = flash_attn_keys(cache, slots[:, None, :], kv_heads[:, None])
    logits = batched_logits(q, keys, kw["scale"], kw.get("softcap"))
    return stats_from_logits(logits, valid, instruction, data)


def fused(cache, query, token_rows, local, kv_heads, slots, valid, instruction, data, **kw):
    out = torch.full((len(token_rows), len(local) + 3, 5), float("nan"), device=query.device)
    fused_stats.span_stats_into(
        out,
        2,
        query,
        token_rows,
        local,
        kv_heads,
        flash_attn_key_view(cache),
        slots,
        valid.sum(1),
        instruction,
        data,
        kw["scale"],
        kw.get("softcap"),
    )
    assert out[:, :2].isnan().all() and out[:, -1].isnan().all()  # only its own columns
    return out[:, 2:-1]


LAYER_HEADS = ((0, 5, 6, 7), (1,), (2, 3, 4, 7))
"""The scored query heads of each layer of ``layers_case`` (8 query heads over 2 kv heads)."""


def layers_case(lengths, spans, layer_heads=LAYER_HEADS, *, seed=0, device="cpu", **shape):
    """Several layers over the same rows, as vLLM holds them: each layer its own cache tensor
    (separately allocated; the second a view into a larger buffer, so the layers lie at
    unrelated distances), its own queries and scored heads; one block table (slots) and one set
    of masks for all. Returns (caches, queries, heads, kv_heads, token_rows, slots, valid,
    instruction, data)."""
    cache, query, token_rows, _, _, slots, valid, instruction, data = paged_case(
        lengths, spans, seed=seed, **shape
    )
    q_heads, kv = query.shape[1], cache.shape[1]
    gen = torch.Generator().manual_seed(seed + 100)
    caches, queries, heads, kv_heads = [], [], [], []
    for i, scored in enumerate(layer_heads):
        if i == 1:  # inside a buffer: a storage offset, and memory before it
            buffer = torch.randn(cache.numel() + 999, generator=gen)
            layer_cache = buffer[999:].view(cache.shape)
        else:
            layer_cache = torch.randn(cache.shape, generator=gen)
        caches.append(layer_cache.to(device))
        queries.append((torch.randn(query.shape, generator=gen) * 2.0).to(device))
        local = torch.tensor(scored)
        heads.append(local.to(device))
        kv_heads.append((local // (q_heads // kv)).to(device))
    rest = (token_rows, slots, valid, instruction, data)
    return caches, queries, heads, kv_heads, *(t.to(device) for t in rest)


def per_layer(path, caches, queries, heads, kv_heads, token_rows, *masks, **kw):
    """Each layer's stats by ``path`` (``fused`` or ``torch_path``), side by side as in the
    probe's table: [rows, every layer's heads, 5]."""
    return torch.cat(
        [
            path(cache, query, token_rows, local, kv, *masks, **kw)
            for cache, query, local, kv in zip(caches, queries, heads, kv_heads, strict=True)
        ],
        dim=1,
    )


def fused_layers(caches, queries, heads, kv_heads, token_rows, slots, valid, instruction, data,
                 *, offsets=None, **kw):  # fmt: skip
    """Every layer's stats by the multi-layer kernel in one launch, as the probe runs it: the
    queries stashed per layer, the column table, the caches by element offset from the first
    (``offsets`` replaces those, to check that a wrong one is caught)."""
    views = [flash_attn_key_view(cache) for cache in caches]
    if offsets is None:
        offsets = fused_stats.key_offsets(views)
        assert None not in offsets
    stash = torch.stack([query.index_select(0, token_rows) for query in queries])
    first = [2 + sum(len(h) for h in heads[:i]) for i in range(len(heads))]  # two columns before
    layers = [
        (i, h.tolist(), k.tolist(), first[i])
        for i, (h, k) in enumerate(zip(heads, kv_heads, strict=True))
    ]
    columns = torch.from_numpy(fused_stats.column_table(layers)).to(stash.device)
    width = sum(len(h) for h in heads)
    out = torch.full((len(token_rows), width + 3, 5), float("nan"), device=stash.device)
    fused_stats.span_stats_layers_into(
        out,
        stash,
        columns,
        views[0],
        torch.tensor(offsets, dtype=torch.long, device=stash.device),
        slots,
        valid.sum(1),
        instruction,
        data,
        kw["scale"],
        kw.get("softcap"),
    )
    assert out[:, :2].isnan().all() and out[:, -1].isnan().all()  # only its own columns
    return out[:, 2:-1]


LAYER_INDICES = (2, 5, 9)


def fused_probe(softcaps=(None, None, None), device="cpu"):
    """A probe over three hooked layers with the fused kernel on (as on a GPU), FlashAttention's
    cache layout; the layers' ``impl`` carries only what the probe reads from vLLM's."""
    from guardrail.worker.fused import FusedLayers
    from guardrail.worker.probe import Layer, Probe, ProbeSettings

    heads = [(i, h) for i, scored in zip(LAYER_INDICES, LAYER_HEADS, strict=True) for h in scored]
    probe = Probe(heads, set(), ProbeSettings(block_size=16, device=device, fused=True), None)
    probe.gather = flash_attn_keys
    probe.fused = FusedLayers(flash_attn_key_view, probe.staging, device)
    for index, scored, softcap in zip(LAYER_INDICES, LAYER_HEADS, softcaps, strict=True):
        local = torch.tensor(scored, device=device)
        impl = SimpleNamespace(scale=0.25, logits_soft_cap=softcap)
        kv = [h // 4 for h in scored]
        kv_column = torch.tensor(kv, device=device)[:, None]
        layer = Layer(index, local, kv_column, list(scored), impl, None, False,
                      host_heads=list(scored), host_kv_heads=kv)  # fmt: skip
        probe.layers[index] = layer
    probe.first_layer, probe.last_layer = LAYER_INDICES[0], LAYER_INDICES[-1]
    probe.ready()
    return probe


def run_step(probe, caches, queries, token_rows, slots, valid, instruction, data):
    """One engine step as vLLM drives the probe: its rows (as ``plan`` builds them), each hooked
    layer's wrapper in order, then ``finish_step``. Returns the step's rows, stats filled in."""
    n = len(token_rows)
    rows = StepRows(
        keys=[f"r{i}" for i in range(n)], batch_index=list(range(n)),
        num_prompt_tokens=valid.sum(1).tolist(), errors=[None] * n, reasons=[None] * n,
        stop_below=[None] * n, stop_on_error=[True] * n, stop_token=[None] * n,
        has_data=data.any(1).tolist(), ok=list(range(n)),
    )  # fmt: skip
    rows.token_rows, rows.token_column = token_rows, token_rows[:, None]
    rows.valid, rows.instruction, rows.data, rows.lengths = valid, instruction, data, valid.sum(1)
    rows.slots, rows.head_slots = slots, slots[:, None, :]
    rows.last_slots = slots.gather(1, (rows.lengths - 1)[:, None])[:, 0]
    rows.flags = torch.zeros(n, len(FLAG_MESSAGES), dtype=torch.bool, device=valid.device)
    probe.rows = rows
    probe.fused.buffers(rows, probe.columns)
    for layer, cache, query in zip(probe.layers.values(), caches, queries, strict=True):
        key = query.new_zeros(query.shape[0], cache.shape[1], query.shape[2])  # new keys
        key[token_rows] = probe.gather(cache, rows.last_slots)
        probe.score_layer(layer, query, cache, key)
    probe.finish_step()
    assert rows.errors == [None] * n and not rows.flags.any()
    return rows
