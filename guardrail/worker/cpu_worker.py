"""The vLLM worker of a compiled CPU engine that reads the hidden state: vLLM's CPU worker,
plus the taps at model load and the data-mean memos before warm-up (``guardrail.worker.taps``).
The engine asks for it with ``LLM(worker_cls=STREAM_TAP_WORKERS["cpu"], additional_config=...)``
(``guardrail.engine.install.stream_tap_arguments``)."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from guardrail.worker.taps import install_memos, install_taps

__all__ = ["GuardrailCPUWorker"]


class GuardrailCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model carries the stream taps before it is compiled."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        install_taps(self.model_runner)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        install_memos(self.model_runner)
        return super().compile_or_warm_up_model(*args, **kwargs)
