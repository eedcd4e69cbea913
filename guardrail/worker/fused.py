"""The probe's fused-kernel path (``guardrail.probe.fused_stats``): one launch per engine step.

In the first step that scores rows, each hooked layer runs its own kernel as its attention
returns (``FusedLayers.layer_stats``) and records its KV cache. ``form_group`` then groups the
layers one kernel can score together (``LayerGroup``: normally all): they share scale, softcap,
query form and their key views' geometry, so the kernel reads each layer's keys at an element
offset from the first's. From then on a grouped layer only copies its scored rows' queries into
the step's stash (``stash``: one ``index_select``), and the end of the step scores every grouped
layer in one launch (``group_stats``), while every layer's keys are still in its cache; a layer
left out of the group keeps its own kernel. Both kernels run one per-(row, head) program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from guardrail.probe.fused_stats import (
    column_table,
    key_offsets,
    span_stats_into,
    span_stats_layers_into,
)
from guardrail.probe.kv_layout import KeyView
from guardrail.probe.scoring import ATTENTION_STATS
from guardrail.worker.layer import Layer
from guardrail.worker.rows import HostStaging, StepRows

__all__ = ["FusedLayers", "LayerGroup"]

WIDTH = len(ATTENTION_STATS)


@dataclass
class LayerGroup:
    """Hooked layers whose stats one kernel computes at the end of each step (see the module
    docstring); the kernel reads each layer's keys at an element offset from the first's
    (``fused_stats.key_offsets``)."""

    layers: list[Layer]  # its members, each with its stash slot
    slots: int  # the stash's layers (a layer that left keeps its slot, unused)
    keys: torch.Tensor  # the first member's key view
    offsets: torch.Tensor  # [slots] int64: each slot's keys from ``keys``, in elements
    columns: torch.Tensor  # [4, columns] int64: ``fused_stats.column_table`` of the members
    scale: float
    softcap: float | None
    query_form: tuple[Any, ...]  # the members' queries: (shape of one token, dtype)


def kernel_form(layer: Layer) -> tuple[Any, ...]:
    """What layers must share to be scored by one kernel, besides their key views' geometry."""
    return float(layer.impl.scale), layer.impl.logits_soft_cap or None, layer.query_form


class FusedLayers:
    """The fused path's state in one worker's probe: the key view of the cache layout, the
    layer group once formed, and why it could not be (``error``)."""

    def __init__(self, key_view: KeyView, staging: HostStaging, device: Any) -> None:
        self.key_view = key_view
        self.staging = staging  # the probe's: host arrays to the device, never synchronising
        self.device = device
        self.group: LayerGroup | None = None
        self.tried = False  # the group was formed (or could not be) ...
        self.error: str | None = None  # ... and why not (each layer keeps its kernel)
        self.caches_moved = False  # a grouped layer's cache has a new address: new offsets

    def buffers(self, rows: StepRows, columns: int) -> None:
        """The step's stats table and, once the layers are grouped, the query stash."""
        shape = (rows.scored, columns, WIDTH)
        rows.stats = torch.empty(shape, dtype=torch.float32, device=self.device)
        group = self.group
        if group is not None:
            token, dtype = group.query_form
            rows.stash = torch.empty(
                (group.slots, rows.scored, *token), dtype=dtype, device=self.device
            )
            rows.stash_slots = rows.stash.unbind(0)  # each layer's part, as views at once

    def stash(self, layer: Layer, rows: StepRows, query: torch.Tensor, kv_cache: Any) -> None:
        """A grouped layer's part of the step: its scored rows' queries into the stash, for the
        group's kernel at the end of the step."""
        # vLLM allocates each layer's cache once, its strides with it: a cache tensor at a new
        # address is the one change to look for (never seen; regrouped at the end)
        if kv_cache.data_ptr() != layer.cache_ptr:
            layer.cache, self.caches_moved = kv_cache, True
        assert rows.token_rows is not None
        torch.index_select(query, 0, rows.token_rows, out=rows.stash_slots[layer.slot])

    def layer_stats(self, layer: Layer, rows: StepRows, query: torch.Tensor, kv_cache: Any) -> None:
        """This layer's stats for every scored row and head, in one kernel, into the step's
        table (``rows.stats``, at the layer's columns). Records the cache and the queries' form
        for grouping (``form_group``)."""
        layer.cache, layer.query_form = kv_cache, (tuple(query.shape[1:]), query.dtype)
        assert rows.stats is not None and rows.token_rows is not None and rows.slots is not None
        assert rows.lengths is not None and rows.instruction is not None and rows.data is not None
        span_stats_into(
            rows.stats,
            layer.column,
            query.view(query.shape[0], -1, query.shape[-1]),
            rows.token_rows,
            layer.local_heads,
            layer.kv_heads[:, 0],
            self.key_view(kv_cache),
            rows.slots,
            rows.lengths,
            rows.instruction,
            rows.data,
            float(layer.impl.scale),
            layer.impl.logits_soft_cap,
        )

    def form_group(self, layers: list[Layer]) -> None:
        """After the first step in which every layer with heads ran its own kernel (so recorded
        its cache): group those one kernel can score with the first (``LayerGroup``); the
        others keep their own kernel. Never raises (without a group, each layer keeps its own)."""
        candidates = [layer for layer in layers if layer.global_heads]
        if any(layer.cache is None for layer in candidates):
            return  # a layer failed before its kernel ran: try after the next step
        self.tried = True
        if not candidates:  # tensor parallelism: this rank holds none of the heads
            return
        try:
            for slot, layer in enumerate(candidates):
                layer.slot = slot
            self._regroup(candidates, len(candidates))
        except Exception as exc:  # the per-layer kernels stay: same results, more host time
            self.group, self.error = None, f"{type(exc).__name__}: {exc}"
            for layer in candidates:
                layer.slot = -1

    def _regroup(self, candidates: list[Layer], slots: int) -> list[tuple[Layer, int]]:
        """Make ``candidates`` (each with its stash slot) the group, less those whose key view
        or kernel form differs from the first's: they leave it (slot -1) and are returned with
        the slot they had. The tables reach the device in one copy, without a synchronisation."""
        views = [self.key_view(layer.cache) for layer in candidates if layer.cache is not None]
        offsets = key_offsets(views)
        form = kernel_form(candidates[0])
        packed = np.zeros(slots, dtype=np.int64)
        members, left = [], []
        for layer, offset in zip(candidates, offsets, strict=True):
            if offset is None or kernel_form(layer) != form or len(layer.query_form[0]) != 2:
                left.append((layer, layer.slot))
                layer.slot = -1
                continue
            packed[layer.slot] = offset
            members.append(layer)
        table = column_table(
            [(lay.slot, lay.host_heads, lay.host_kv_heads, lay.column) for lay in members]
        )
        values = self.staging.to_device(np.concatenate([packed, table.ravel()]))
        scale, softcap, query_form = form
        columns = values[slots:].view(4, table.shape[1])
        self.group = LayerGroup(
            members, slots, views[0], values[:slots], columns, scale, softcap, query_form
        )
        for layer in members:
            assert layer.cache is not None
            layer.cache_ptr = layer.cache.data_ptr()
        return left

    def group_stats(self, rows: StepRows) -> None:
        """Every grouped layer's stats of the step, in one kernel, into ``rows.stats``. Should a
        grouped layer's cache have moved (never seen: vLLM allocates the caches once), the
        offsets are rebuilt first; a layer that no longer fits is scored alone from the stash."""
        group, stats, queries = self.group, rows.stats, rows.stash
        assert group is not None and stats is not None and queries is not None
        assert rows.slots is not None and rows.lengths is not None
        assert rows.instruction is not None and rows.data is not None
        masks = (rows.slots, rows.lengths, rows.instruction, rows.data)
        if self.caches_moved:
            self.caches_moved = False
            for layer, slot in self._regroup(group.layers, group.slots):
                assert layer.cache is not None
                scale, softcap, _ = kernel_form(layer)
                token_rows = torch.arange(rows.scored, device=stats.device)
                heads = (layer.local_heads, layer.kv_heads[:, 0], self.key_view(layer.cache))
                span_stats_into(
                    stats, layer.column, queries[slot], token_rows, *heads, *masks,
                    scale, softcap,
                )  # fmt: skip
            group = self.group
            assert group is not None
        span_stats_layers_into(
            stats, queries, group.columns, group.keys, group.offsets, *masks,
            group.scale, group.softcap,
        )  # fmt: skip
