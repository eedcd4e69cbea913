"""The vLLM worker of a compiled CUDA engine that reads the hidden state: vLLM's GPU worker,
plus, at model load, the taps and the taps' op among the splitting ops (so piecewise CUDA
graphs run it as Python between the pieces), and, before the CUDA graphs are captured, the
data-mean memos whose writes the full graphs capture (``guardrail.worker.taps``). The engine
asks for it with ``LLM(worker_cls=STREAM_TAP_WORKERS["cuda"], additional_config=...)``
(``guardrail.engine.install.stream_tap_arguments``)."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from guardrail.worker.taps import install_memos, install_taps, split_at_stream_op

__all__ = ["GuardrailGPUWorker"]


class GuardrailGPUWorker(Worker):
    """vLLM's GPU worker whose model carries the stream taps before it is compiled."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        split_at_stream_op(self.vllm_config)
        super().load_model(*args, **kwargs)
        install_taps(self.model_runner)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        install_memos(self.model_runner)
        return super().compile_or_warm_up_model(*args, **kwargs)
