"""The vLLM worker of a compiled CPU engine that reads the hidden state: it taps the decoder
layers at model load, before vLLM compiles the model.

vLLM loads the model (``load_model``), then compiles it on the first forward pass (the CPU
worker's warm-up) and, from then on, runs the compiled graphs, whatever hooks are added later.
``GuardrailCPUWorker`` is vLLM's CPU worker plus one step at the end of ``load_model``: a
forward hook (``guardrail.worker.stream_op.make_tap``) on each decoder layer listed under
``STREAM_TAPS_KEY`` in the engine's ``additional_config``, which torch.compile then traces into
the graph as a call of the ``guardrail::read_stream`` op. The engine asks for it with
``LLM(worker_cls=STREAM_TAP_WORKERS["cpu"], additional_config={STREAM_TAPS_KEY: layers})``
(``guardrail.engine.install.stream_tap_arguments``); the layers are in ``additional_config``
because vLLM hashes it into its compile-cache key.

The taps do nothing until the probe is installed and connects a reader to them
(``guardrail.worker.hidden.install_hidden``); an engine without guardrail's probe runs them as
empty op calls.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from guardrail.protocol import STREAM_TAPS_KEY
from guardrail.worker.forward import decoder_layers
from guardrail.worker.stream_op import make_tap

__all__ = ["GuardrailCPUWorker", "install_taps", "tap_layers"]


def tap_layers(vllm_config: Any) -> list[int]:
    """The decoder layers the engine asked to tap (``additional_config[STREAM_TAPS_KEY]``)."""
    extra = getattr(vllm_config, "additional_config", None)
    layers = extra.get(STREAM_TAPS_KEY, []) if isinstance(extra, dict) else []
    return sorted({int(layer) for layer in layers})


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


class GuardrailCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model carries the stream taps before it is compiled."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        install_taps(self.model_runner)
