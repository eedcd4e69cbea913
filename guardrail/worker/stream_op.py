"""``guardrail::read_stream``: how a compiled model hands a decoder layer's residual stream to
the hidden-state reader (``guardrail.worker.hidden``).

In vLLM's compiled mode the decoder layers run inside graphs that torch.compile traced once,
so a Python forward hook added after that never runs. A hook that is already on the layer when
vLLM compiles is traced into the graph, and so is what it calls: here one custom op, with the
layer's output ``(hidden, residual)`` and the layer's index. The op is registered as having a
side effect (``torch.fx.node.has_side_effect``) so Dynamo, AOTAutograd and Inductor keep it
though nothing uses its (empty) result, and it has a fake implementation for tracing. The
compiled graph then calls its real implementation with the real tensors in every step, and that
looks up the reader of this engine's layer (``READERS``) and calls it: the same reader the eager
hook calls, so both modes compute the same terms from the same tensors.

Readers are keyed by the engine: several engines in one process (vLLM's in-process mode) share
the op, and each step's forward context names its engine through ``no_compile_layers``, its
``compilation_config.static_forward_context``, one dict per engine. Without a forward context
(warm-up, profiling, compile tracing) or a reader (before the probe is installed, after it is
removed) the op does nothing.

Example:
    >>> engine = {}  # an engine's static_forward_context
    >>> seen = []
    >>> handle = READERS.connect(engine, 2, lambda hidden, residual: seen.append(hidden.sum()))
    >>> READERS.reader(engine, 2) is not None, READERS.reader(engine, 1)
    (True, None)
    >>> handle.remove()
    >>> READERS.reader(engine, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import has_side_effect

from guardrail.protocol import STREAM_OP

__all__ = [
    "MEMOS",
    "OP_NAME",
    "READERS",
    "ReaderHandle",
    "StreamReaders",
    "make_tap",
    "read_stream",
    "tapped_layers",
]

OP_NAME = STREAM_OP

Reader = Callable[[torch.Tensor, torch.Tensor | None], None]
"""A layer's reader: called with the layer's ``(hidden, residual)`` output, never raises."""


class ReaderHandle:
    """Disconnects one reader (``remove``, like a hook's ``RemovableHandle``); idempotent."""

    def __init__(self, readers: StreamReaders, engine: dict[str, Any], layer: int) -> None:
        self._readers, self._engine, self._layer = readers, engine, layer

    def remove(self) -> None:
        self._readers.disconnect(self._engine, self._layer)


class StreamReaders:
    """The readers of every engine in this process, by engine and decoder layer.

    An engine is its ``static_forward_context`` dict (the one object both the model runner and
    each step's forward context hold). An entry keeps that dict alive, so its ``id`` cannot be
    reused by another engine while the entry exists."""

    def __init__(self) -> None:
        self._engines: dict[int, tuple[dict[str, Any], dict[int, Reader]]] = {}

    def connect(self, engine: dict[str, Any], layer: int, reader: Reader) -> ReaderHandle:
        """Call ``reader`` when ``engine``'s tap on ``layer`` fires (replaces a reader there)."""
        _, layers = self._engines.setdefault(id(engine), (engine, {}))
        layers[layer] = reader
        return ReaderHandle(self, engine, layer)

    def disconnect(self, engine: dict[str, Any], layer: int) -> None:
        entry = self._engines.get(id(engine))
        if entry is None or entry[0] is not engine:
            return
        entry[1].pop(layer, None)
        if not entry[1]:
            del self._engines[id(engine)]

    def reader(self, engine: Any, layer: int) -> Reader | None:
        """The reader of ``engine``'s ``layer``, or None."""
        entry = self._engines.get(id(engine))
        if entry is None or entry[0] is not engine:
            return None
        return entry[1].get(layer)

    def __len__(self) -> int:
        return sum(len(layers) for _, layers in self._engines.values())


READERS = StreamReaders()
"""The process's readers: ``guardrail.worker.hidden`` connects them at probe install."""
MEMOS = StreamReaders()
"""The process's data-mean memo writers (``guardrail.worker.hidden.MemoWriter``): the worker
connects them before vLLM captures its CUDA graphs (``guardrail.worker.taps.install_memos``).
The op calls a layer's writer before its reader."""


def _current_engine() -> Any:
    """The engine of the running step (its ``static_forward_context``), or None outside a
    step."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return get_forward_context().no_compile_layers


@torch.library.custom_op(OP_NAME, mutates_args=())
def read_stream(hidden: torch.Tensor, residual: torch.Tensor | None, layer: int) -> None:
    """Hand decoder layer ``layer``'s output stream (``hidden`` [tokens, hidden_size] and its
    ``residual``, or None) to this engine's reader of that layer, if there is one."""
    engine = _current_engine()
    if engine is None:
        return
    for readers in (MEMOS, READERS):
        reader = readers.reader(engine, layer)
        if reader is not None:
            reader(hidden, residual)


@read_stream.register_fake
def _read_stream_fake(hidden: torch.Tensor, residual: torch.Tensor | None, layer: int) -> None:
    return None


has_side_effect(torch.ops.guardrail.read_stream.default)  # kept though its result is unused


def make_tap(layer: int) -> Callable[[Any, Any, Any], None]:
    """The forward hook a decoder layer carries from model load on: it calls the op with the
    layer's output. Traced by torch.compile into the layer's graph; marked with the layer
    (``tapped_layers``)."""

    def tap(module: Any, args: Any, output: Any) -> None:
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        torch.ops.guardrail.read_stream(hidden, residual, layer)

    tap.guardrail_tap = layer  # type: ignore[attr-defined]
    return tap


def tapped_layers(layers: Any) -> set[int]:
    """The indices of the decoder ``layers`` (a module list) that carry a tap."""
    found = set()
    for index, module in enumerate(layers):
        hooks = getattr(module, "_forward_hooks", {}).values()
        if any(getattr(h, "guardrail_tap", None) == index for h in hooks):
            found.add(index)
    return found
