"""What a compiled engine's worker does to its model before vLLM compiles it and captures its
CUDA graphs, so the hidden-state read-outs run in compiled mode
(docs/compiled-hidden.md):

- ``install_taps`` (at model load): a forward hook (``guardrail.worker.stream_op.make_tap``)
  on each decoder layer listed under ``STREAM_TAPS_KEY`` in the engine's ``additional_config``,
  which torch.compile traces into the graph as a call of the ``guardrail::read_stream`` op;
- ``split_at_stream_op`` (at model load, CUDA): the op joins vLLM's splitting ops, so under
  piecewise CUDA graphs it runs as Python between the captured pieces, like attention;
- ``install_memos`` (after the KV cache is allocated, before CUDA graphs are captured): the
  memo of each data read-out under ``STREAM_MEMOS_KEY``, written by the op in every step
  (``guardrail.worker.hidden.MemoWriter``), also inside full CUDA graphs.

The workers that call them: ``guardrail.worker.cpu_worker`` and ``guardrail.worker.gpu_worker``
(``guardrail.protocol.STREAM_TAP_WORKERS``); ``guardrail.engine.install.stream_tap_arguments``
asks for them. The layers and read-outs are in ``additional_config`` because vLLM hashes it into
its compile-cache key. The taps do nothing until the probe is installed and connects a reader
to them (``guardrail.worker.hidden.install_hidden``), apart from the memo writes.
"""

from __future__ import annotations

import weakref
from typing import Any

from guardrail.probe.config import HiddenLayerProbe
from guardrail.protocol import STREAM_MEMOS_KEY, STREAM_OP, STREAM_TAPS_KEY
from guardrail.worker.forward import decoder_layers
from guardrail.worker.hidden import LayerMemos, MemoWriter, Readout, kv_slots, new_memo
from guardrail.worker.stream_op import MEMOS, make_tap, tapped_layers

__all__ = ["install_memos", "install_taps", "memo_readouts", "split_at_stream_op", "tap_layers"]


def _extra(vllm_config: Any) -> dict[str, Any]:
    extra = getattr(vllm_config, "additional_config", None)
    return extra if isinstance(extra, dict) else {}


def tap_layers(vllm_config: Any) -> list[int]:
    """The decoder layers the engine asked to tap (``additional_config[STREAM_TAPS_KEY]``)."""
    return sorted({int(layer) for layer in _extra(vllm_config).get(STREAM_TAPS_KEY, [])})


def memo_readouts(vllm_config: Any) -> dict[int, list[HiddenLayerProbe]]:
    """The data read-outs whose memos the worker keeps, by decoder layer
    (``additional_config[STREAM_MEMOS_KEY]``)."""
    by_layer: dict[int, list[HiddenLayerProbe]] = {}
    for spec in _extra(vllm_config).get(STREAM_MEMOS_KEY) or []:
        part = HiddenLayerProbe.model_validate(spec)
        by_layer.setdefault(part.layer, []).append(part)
    return by_layer


def install_taps(runner: Any) -> list[int]:
    """Tap the decoder layers of ``tap_layers`` in ``runner``'s model (before it is compiled);
    returns the tapped layers. A layer this pipeline stage does not hold is skipped; a layer
    the model does not have is an error (vLLM then fails to start, with this message)."""
    wanted = tap_layers(runner.vllm_config)
    if not wanted:
        return []
    layers = decoder_layers(runner)
    if layers is None or max(wanted) >= len(layers):
        count = "no" if layers is None else len(layers)
        raise ValueError(
            f"{STREAM_TAPS_KEY} asks for decoder layers {wanted}; "
            f"{type(runner.model).__name__} has {count} model.layers"
        )
    tapped = []
    for index in wanted:
        if type(layers[index]).__name__ == "PPMissingLayer":
            continue
        layers[index].register_forward_hook(make_tap(index))
        tapped.append(index)
    return tapped


def split_at_stream_op(vllm_config: Any) -> bool:
    """Add ``STREAM_OP`` to the splitting ops vLLM settled on (its attention ops, or the
    user's), so piecewise CUDA graphs leave the taps' op out and it runs between the pieces.
    Called in the worker before the model is compiled (the compile-cache key hashes the
    splitting ops). No change where vLLM does not split (no piecewise compilation)."""
    compilation = vllm_config.compilation_config
    ops = compilation.splitting_ops
    if not tap_layers(vllm_config) or not ops or STREAM_OP in ops:
        return False
    ops.append(STREAM_OP)
    return True


def install_memos(runner: Any) -> list[int]:
    """Make the memo of each data read-out of ``memo_readouts`` (one float32 per KV slot, plus
    a spare entry for padded tokens, NaN until written) and connect the layer's writers to its
    tap: after the KV cache is allocated (its size), before vLLM captures CUDA graphs (so the
    full graphs capture the writes). Returns the layers."""
    readouts = memo_readouts(runner.vllm_config)
    if not readouts:
        return []
    layers = decoder_layers(runner) or []
    count = len(layers)
    tapped = tapped_layers(layers)
    held = [i for i in readouts if i in tapped]
    missing = [  # a layer another pipeline stage holds is that stage's
        i
        for i in sorted(set(readouts) - tapped)
        if i >= count or type(layers[i]).__name__ != "PPMissingLayer"
    ]
    if missing:
        raise ValueError(f"{STREAM_MEMOS_KEY} names decoder layers {missing}, which are not tapped")
    slots = kv_slots(runner)
    engine = runner.vllm_config.compilation_config.static_forward_context
    for index in held:
        writers: dict[str, MemoWriter] = {
            part.position: MemoWriter(
                Readout.of(part, runner.device), new_memo(slots, runner.device)
            )
            for part in readouts[index]
        }
        MEMOS.connect(engine, index, LayerMemos(writers))
        weakref.finalize(runner, MEMOS.disconnect, engine, index)  # dropped with the engine
    return sorted(held)
