"""The worker extension: the RPC surface of the worker side (``guardrail.protocol``'s RPC_*).

vLLM instantiates ``GuardrailWorkerExtension`` as a mixin of its worker (``worker_extension_cls``),
in the worker process, and the caller drives it with ``collective_rpc``. The extension holds two
components and forwards to them: the attention probe (``guardrail.worker.probe``) and the
steering/capture hooks (``guardrail.worker.steering``). The ``guardrail.worker`` package is the
only code that touches vLLM internals.
"""

from __future__ import annotations

import re
from typing import Any

from guardrail.probe.config import ModelProbeConfig
from guardrail.protocol import NOT_GUARDABLE, ModelInfo, PoppedResults, SteerReportData
from guardrail.worker import lifecycle
from guardrail.worker.outbox import ResultPusher
from guardrail.worker.probe import PROBES, Probe, install_probe, uninstall_probe
from guardrail.worker.steering import SteeringHooks

__all__ = ["GuardrailWorkerExtension"]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class GuardrailWorkerExtension:
    """Mixed into vLLM's worker class; every public method is called through ``collective_rpc``.

    ``self.model_runner`` is the worker's (vLLM's) model runner.
    """

    model_runner: Any  # provided by vLLM's worker class
    _guardrail_probe: Probe | None = None
    _guardrail_steering: SteeringHooks | None = None
    _guardrail_faults: set[str] | None = None
    _guardrail_pusher: ResultPusher | None = None

    # -- facts -----------------------------------------------------------------------------------
    def guardrail_model_info(self) -> ModelInfo:
        """Sizes, backend and compilation facts the caller validates configs against."""
        from vllm.distributed import parallel_state

        vcfg = self.model_runner.vllm_config
        text_cfg = vcfg.model_config.hf_text_config
        layers = self._attention_layers()
        first = next(iter(layers.values()))
        return {
            "num_layers": int(text_cfg.num_hidden_layers),
            "num_heads": int(text_cfg.num_attention_heads),
            "num_kv_heads": int(
                getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads)
            ),
            "hidden_size": int(text_cfg.hidden_size),
            "attention_layers": len(layers),
            "backend": type(first.impl).__name__,
            "isa": getattr(first, "isa", None),
            "kv_cache_dtype": str(vcfg.cache_config.cache_dtype),
            "dtype": str(vcfg.model_config.dtype).removeprefix("torch."),
            "block_size": int(vcfg.cache_config.block_size),
            "enforce_eager": bool(vcfg.model_config.enforce_eager),
            "compilation_mode": str(getattr(vcfg.compilation_config, "mode", None)),
            "cudagraph_mode": str(getattr(vcfg.compilation_config, "cudagraph_mode", None)),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pp_size": parallel_state.get_pp_group().world_size,
            "device": str(self.model_runner.device),
            "fast_exit": lifecycle.armed(),
        }

    def _attention_layers(self) -> dict[int, Any]:
        context = self.model_runner.vllm_config.compilation_config.static_forward_context
        layers = {}
        for name, module in context.items():
            match = _LAYER_INDEX.search(name)
            if match and hasattr(module, "impl"):
                layers[int(match.group(1))] = module
        return layers

    # -- the probe -------------------------------------------------------------------------------
    def _faults(self) -> set[str]:
        if self._guardrail_faults is None:
            self._guardrail_faults = set()
        return self._guardrail_faults

    def guardrail_install(
        self,
        heads: list[list[int]],
        config: dict[str, Any],
        raw_hidden_layers: list[int] | None = None,
        raw_data_mean_layers: list[int] | None = None,
    ) -> ModelInfo:
        """Install the probe on the layers holding ``heads`` ([layer, head], global indices).

        ``config`` is the model's ``ModelProbeConfig`` as plain data: the worker combines head
        scores and hidden-state terms into the focus itself, for early stops (with tensor
        parallelism, after the ranks exchanged their heads). ``raw_hidden_layers``: decoder
        layers whose whole residual stream at the last prompt token is returned, and
        ``raw_data_mean_layers`` those whose stream averaged over the data tokens is
        (calibration).
        """
        try:
            return self._install(heads, config, raw_hidden_layers, raw_data_mean_layers)
        except ValueError as exc:  # a refusal: recognisable at the caller (``NOT_GUARDABLE``)
            raise ValueError(f"{NOT_GUARDABLE}{exc}") from exc

    def _install(
        self,
        heads: list[list[int]],
        config: dict[str, Any],
        raw_hidden_layers: list[int] | None,
        raw_data_mean_layers: list[int] | None,
    ) -> ModelInfo:
        self.guardrail_uninstall()
        info = self.guardrail_model_info()
        if info["kv_cache_dtype"] not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"quantized KV cache ({info['kv_cache_dtype']}) is not supported by "
                "the probe: keys read back would be quantized; use kv_cache_dtype='auto'"
            )
        whole = ModelProbeConfig.model_validate(config)
        probe = install_probe(
            self.model_runner,
            self._attention_layers(),
            [(int(a), int(b)) for a, b in heads],
            dict(info),
            self._faults(),
            whole,
            [int(layer) for layer in raw_hidden_layers or []],
            [int(layer) for layer in raw_data_mean_layers or []],
        )
        self._guardrail_probe = probe
        PROBES[id(self.model_runner.vllm_config)] = probe
        return {
            **info,
            "hooked_layers": sorted(probe.layers),
            "hidden_layers": sorted(probe.hidden),
            "probe_kernel": "triton" if probe.settings.fused else "torch",
        }

    def guardrail_uninstall(self) -> None:
        """Remove the probe; the engine runs exactly as before it was installed."""
        self.guardrail_push_results(None, "")
        if self._guardrail_probe is not None:
            uninstall_probe(self._guardrail_probe)
        self._guardrail_probe = None
        PROBES.pop(id(self.model_runner.vllm_config), None)

    def guardrail_pop_results(self, keys: list[str]) -> PoppedResults:
        """Remove and return the stored results of ``keys`` (missing keys are absent), with the
        order of the heads in their stats, and which of the others the pusher took (on their
        way to the caller's socket: ``PoppedResults.pushed``)."""
        probe = self._guardrail_probe
        if probe is None:
            return {"heads": [], "results": {}}
        results = probe.pop(keys)  # waits for the pusher first: each result is here or sent
        popped: PoppedResults = {"heads": probe.head_order, "results": results}
        pusher = self._guardrail_pusher
        if pusher is not None:
            popped["pushed"] = pusher.in_transit([k for k in keys if k not in results])
        return popped

    def guardrail_push_results(self, address: str | None, hello: str) -> bool:
        """Push results to the caller's socket at ``address`` (``guardrail.worker.outbox``),
        starting with ``hello``; None stops. Returns whether this rank pushes: rank 0 of
        tensor parallelism does (after the ranks combined their heads it holds every head),
        the other ranks then keep no results; with pipeline parallelism nobody does (each
        stage holds its own layers) and results are popped."""
        from vllm.distributed import parallel_state

        if self._guardrail_pusher is not None:
            self._guardrail_pusher.close()
            self._guardrail_pusher = None
        probe = self._guardrail_probe
        if probe is None or address is None or probe.settings.pp_size > 1:
            if probe is not None:
                probe.store.discard = False
            return False
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            probe.store.discard = True
            return False
        self._guardrail_pusher = ResultPusher(address, probe.store, hello, probe.head_order)
        return True

    def guardrail_set_faults(self, keys: list[str]) -> None:
        """Testing hook: requests with these probe keys fail inside the probe."""
        faults = self._faults()
        faults.clear()
        faults.update(keys)

    # -- steering and capture --------------------------------------------------------------------
    def _steering(self) -> SteeringHooks:
        if self._guardrail_steering is None:
            self._guardrail_steering = SteeringHooks(self.model_runner)
        return self._guardrail_steering

    def guardrail_load_steering(
        self, name: str, direction: list[float], layer: int, avg_proj: float
    ) -> list[int]:
        """Keep a vector under ``name`` and hook its layer; returns the hooked layers."""
        return self._steering().load(name, direction, layer, avg_proj)

    def guardrail_unload_steering(self, names: list[str] | None = None) -> list[int]:
        """Forget vectors (all when ``names`` is None); returns the hooked layers."""
        return self._steering().unload(names)

    def guardrail_capture_layers(self, layers: list[int]) -> list[int]:
        """Capture the stream at these layers for requests carrying ``CAPTURE_ARG``."""
        return self._steering().capture(layers)

    def guardrail_pop_steering(self, keys: list[str]) -> dict[str, SteerReportData]:
        """Remove and return the steering/capture reports of ``keys``."""
        return self._steering().pop(keys)
