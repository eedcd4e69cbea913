"""Starting a hooked engine, shared by the sync ``HookedLLM`` and the ``AsyncHookedLLM``: the
engine arguments that load the worker extension, the checks of the served model against the
probe config, the heads to score, and the self-test that refuses to run unguarded.

Example:
    >>> kwargs = engine_arguments({"dtype": "float32"})
    >>> kwargs["worker_extension_cls"] == WORKER_EXTENSION, kwargs["logits_processors"]
    (True, ['guardrail.worker.stop:ProbeStopLogitsProcessor'])
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from guardrail.engine.engine_process import EngineHandle
from guardrail.engine.types import GuardedOutput
from guardrail.errors import ConfigError, EngineNotGuardableError
from guardrail.probe.config import DATA_POSITIONS, ModelProbeConfig, resolve_config
from guardrail.probe.scoring import HeadKey
from guardrail.protocol import (
    STOP_PROCESSOR,
    STREAM_MEMOS_KEY,
    STREAM_TAP_WORKERS,
    STREAM_TAPS_KEY,
    WORKER_EXTENSION,
    ModelInfo,
)

LOG = logging.getLogger("guardrail")

__all__ = [
    "SELF_TEST_REQUEST",
    "check_self_test",
    "check_served_model",
    "check_sizes_from_files",
    "engine_arg",
    "engine_arguments",
    "engine_probe_config",
    "heads_to_score",
    "stream_tap_arguments",
]


def engine_arg(text: str) -> tuple[str, Any]:
    """A command line's ``--engine-arg KEY=VALUE``: a vLLM engine argument, its value parsed as
    JSON when it is JSON (``true``, ``0.9``, ``{"mode": 0}``), else kept as text.

    Example:
        >>> engine_arg("enforce-eager=false"), engine_arg("attention_backend=FLASH_ATTN")
        (('enforce_eager', False), ('attention_backend', 'FLASH_ATTN'))
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg takes key=value, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


SELF_TEST_REQUEST = ("Reply with OK.", "self test")
"""The request every engine answers once at start, with one token: it must come back scored."""


def engine_arguments(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The user's engine arguments plus the probe's worker extension and stop processor."""
    if "worker_extension_cls" in engine_kwargs:
        raise ConfigError(
            "worker_extension_cls is set by the guardrail (the probe lives there); "
            "remove it from the engine arguments"
        )
    processors = [*(engine_kwargs.get("logits_processors") or []), STOP_PROCESSOR]
    return {
        **engine_kwargs,
        "worker_extension_cls": WORKER_EXTENSION,
        "logits_processors": processors,
    }


def engine_probe_config(
    model: str,
    probe_config: ModelProbeConfig | str | Path | None,
    engine_kwargs: dict[str, Any],
    *,
    announce: bool = True,
) -> ModelProbeConfig:
    """The probe config for an engine started with ``engine_kwargs``: ``resolve_config``, told
    whether the engine will run eager (``enforce_eager=True`` given, or the CPU default of
    ``EngineHandle.start_arguments``); with no config given, an eager engine of the embedded
    SmolLM2 reads the ``combined`` variant, and so does a compiled one on a device whose
    compiled engines read the hidden state (``STREAM_TAP_WORKERS``: CPU and CUDA); a compiled
    engine elsewhere reads the attention-only default.
    ``announce``: log a config that was never calibrated (the engines do, once at start-up;
    a guard's every verdict says it too)."""
    eager = EngineHandle.start_arguments(engine_kwargs).get("enforce_eager") is True
    reads_hidden = eager or _device_type() in STREAM_TAP_WORKERS
    config = resolve_config(model, probe_config, reads_hidden=reads_hidden)
    if announce and config.uncalibrated is not None:
        LOG.warning("guardrail: %s", config.uncalibrated)
    return config


def _device_type() -> str:
    """The device type vLLM runs on here ("cpu", "cuda", ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def stream_tap_arguments(
    arguments: dict[str, Any], config: ModelProbeConfig, raw_layers: Sequence[int] = ()
) -> dict[str, Any]:
    """``arguments`` (the engine's start arguments, defaults filled in) plus, for a compiled
    engine that reads decoder layers (``config.hidden`` and ``raw_layers``, calibration's), on
    a device with a tapping worker (``STREAM_TAP_WORKERS``), that worker, the layers it taps
    at model load and the config's data read-outs, whose memos it keeps
    (``additional_config``, which vLLM hashes into its compile-cache key;
    docs/compiled-hidden.md). Any other engine's arguments come back unchanged: an eager
    engine reads through forward hooks, and a compiled one on another device refuses a hidden
    config at install.

    Example:
        >>> config = ModelProbeConfig(model_id="m", heads=[(0, 1)])
        >>> stream_tap_arguments({"enforce_eager": False}, config)
        {'enforce_eager': False}
    """
    layers = sorted(set(config.hidden_layers) | {int(layer) for layer in raw_layers})
    if not layers or arguments.get("enforce_eager") is True:
        return arguments
    worker = STREAM_TAP_WORKERS.get(_device_type())
    if worker is None:
        return arguments
    if arguments.get("worker_cls", "auto") not in ("auto", worker):
        raise ConfigError(
            f"worker_cls is set by the guardrail for a compiled engine that reads the hidden "
            f"state ({worker}: it taps the decoder layers before vLLM compiles them); remove "
            "it from the engine arguments, or start with enforce_eager=True"
        )
    extra = dict(arguments.get("additional_config") or {})
    extra[STREAM_TAPS_KEY] = layers
    parts = config.hidden or []
    memos = [p.model_dump(mode="json") for p in parts if p.position in DATA_POSITIONS]
    if memos:  # kept by the worker from before CUDA graph capture
        extra[STREAM_MEMOS_KEY] = memos
    return {**arguments, "worker_cls": worker, "additional_config": extra}


def check_sizes_from_files(model: str, config: ModelProbeConfig) -> None:
    """Fail before the engine starts when a local model's config.json shows the heads do not fit."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return  # a hub id: checked against the loaded model after start
    hf = json.loads(config_file.read_text())
    hf = hf.get("text_config", hf)
    if "num_hidden_layers" in hf and "num_attention_heads" in hf:
        config.check_fits(int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]))


def check_served_model(info: ModelInfo, config: ModelProbeConfig, model: str) -> None:
    """The served model must fit the config (sizes; another id only warns), and prefill must
    not run as a full CUDA graph, where the probe cannot run."""
    mode = info["cudagraph_mode"]
    if "FULL" in mode and "DECODE_ONLY" not in mode and "PIECEWISE" not in mode:
        raise EngineNotGuardableError(
            f"cudagraph_mode {mode} replays prefill as a full CUDA graph, where the probe "
            "cannot run; use the default FULL_AND_PIECEWISE, PIECEWISE, or enforce_eager=True"
        )
    config.check_fits(info["num_layers"], info["num_heads"])
    config.check_model(model, info)


def heads_to_score(
    config: ModelProbeConfig, info: ModelInfo, probe_heads: Sequence[HeadKey] | str | None
) -> list[HeadKey]:
    """The config's heads, every head ("all", for calibration), or the given ones (checked)."""
    if probe_heads == "all":
        return [(lay, h) for lay in range(info["num_layers"]) for h in range(info["num_heads"])]
    if probe_heads is None:
        return list(config.heads)
    heads = [(int(h[0]), int(h[1])) for h in probe_heads]
    ModelProbeConfig(model_id="override", heads=heads).check_fits(
        info["num_layers"], info["num_heads"]
    )
    return heads


def check_self_test(out: GuardedOutput) -> None:
    """Refuse to run unguarded: the self-test request must have come back scored."""
    if out.error is not None:  # the request never reached the engine: the model's files
        raise EngineNotGuardableError(
            f"the self-test request could not be rendered for this model ({out.error}); the "
            "guard renders every request with the tokenizer's chat template, so the model "
            "directory needs one (chat_template.jinja or tokenizer_config.json)"
        )
    if out.probe is None or out.probe.error is not None or out.probe.focus is None:
        reason = out.probe.error if out.probe else "no probe result"
        raise EngineNotGuardableError(
            f"the probe did not fire in this engine configuration ({reason}); this happens "
            "when the attention implementation runs inside a captured graph. Start the "
            "engine with enforce_eager=True."
        )
