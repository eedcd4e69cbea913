"""``HookedLLM``: a vLLM engine whose Attention Tracker probe runs inside the real generation.

One pass: the probe reads attention during the prefill of the request's own generation (no
extra probe pass), computes per-head focus scores inside the worker on the model's device, and
returns a few numbers per request. The caller-side work here is rendering prompts into token
spans, attaching each request's probe spec, and matching results back by the key it carries.

Example:
    >>> with HookedLLM(dtype="float32") as llm:  # doctest: +SKIP
    ...     out = llm.generate([("Summarize the email.", "Hi, lunch at noon?")])[0]
    ...     print(out.probe.focus, out.text)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from guardrail.config import ModelProbeConfig, load_model_config, read_model_config
from guardrail.errors import ConfigError, EngineNotGuardableError, GuardrailError
from guardrail.prompts import PreparedPrompt, RequestLike, prepare_prompt
from guardrail.scoring import HeadKey, head_focus
from guardrail.steering_engine import (
    STEER_ARG,
    SteeringEngineMixin,
    SteeringLike,
    SteeringReport,
)

WORKER_EXTENSION = "guardrail._vllm_worker.GuardrailWorkerExtension"
STOP_PROCESSOR = "guardrail._vllm_worker:ProbeStopLogitsProcessor"
PROBE_ARG = "guardrail_probe"  # same value as guardrail._vllm_worker.PROBE_ARG (kept import-free)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured for one request (``error`` set when it could not score)."""

    focus: float | None
    head_scores: dict[HeadKey, float] = field(default_factory=dict)  # focus per head
    head_stats: dict[HeadKey, tuple[float, ...]] = field(default_factory=dict)  # ATTENTION_STATS
    error: str | None = None
    num_prompt_tokens: int = 0
    probe_seconds: float = 0.0
    stopped: bool = False  # ended right after prefill by ``stop_below``


@dataclass(frozen=True)
class GuardedOutput:
    """One request's result: its prompt and spans (for audit), the text, and the probe result.

    ``error`` is set (and ``probe`` is None) when the request itself was invalid; it was then not
    sent to the engine, and the other requests of the batch were answered normally.
    """

    index: int
    prompt: PreparedPrompt | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    probe: ProbeResult | None = None
    error: GuardrailError | None = None
    steering: SteeringReport | None = None  # set for steered requests


def per_request(value: Any, n: int, name: str) -> list[Any]:
    """``value`` once per request: a sequence (not a string) must have one entry per request.

    Example:
        >>> per_request(0.5, 2, "stop_below"), per_request([1, 2], 2, "stop_below")
        ([0.5, 0.5], [1, 2])
        >>> per_request([1], 2, "stop_below")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        guardrail.errors.ConfigError: got 1 values of stop_below for 2 requests; pass one, ...
    """
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ConfigError(
                f"got {len(value)} values of {name} for {n} requests; pass one, or one per request"
            )
        return list(value)
    return [value] * n


def _merge_rank_results(per_rank: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Tensor-parallel ranks each score their own heads; union them (errors win)."""
    merged: dict[str, Any] = {
        "heads": {},
        "error": None,
        "num_prompt_tokens": 0,
        "seconds": 0.0,
        "stopped": False,
    }
    for rank in per_rank:
        result = rank.get(key)
        if result is None:
            continue
        merged["error"] = merged["error"] or result.get("error")
        merged["num_prompt_tokens"] = result["num_prompt_tokens"]
        merged["seconds"] = max(merged["seconds"], result["probe_seconds"])
        merged["stopped"] = merged["stopped"] or bool(result.get("stopped"))
        for layer, head, stats in result.get("heads", []):
            merged["heads"][(layer, head)] = tuple(stats)
    return merged


def _check_sizes_from_files(model: str, config: ModelProbeConfig) -> None:
    """Fail before the engine starts when a local model's config.json shows the heads do not fit."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return  # a hub id: checked against the loaded model after start
    hf = json.loads(config_file.read_text())
    hf = hf.get("text_config", hf)
    if "num_hidden_layers" in hf and "num_attention_heads" in hf:
        config.check_fits(int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]))


class HookedLLM(SteeringEngineMixin):
    """A ``vllm.LLM`` with the guardrail probe installed in its workers.

    ``model`` is a model path or id (default: the embedded SmolLM2-135M-Instruct);
    ``probe_config`` a ``ModelProbeConfig``, a JSON path, or None to use the shipped config for
    the model; ``probe_heads`` overrides which heads are scored ("all" scores every head of
    every layer, for calibration). Other keyword arguments go to ``vllm.LLM`` unchanged.
    Steering (``load_steering_vector``, ``generate(steering=...)``) needs ``enforce_eager=True``.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        probe_config: ModelProbeConfig | str | Path | None = None,
        *,
        probe_heads: Sequence[HeadKey] | str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if "worker_extension_cls" in engine_kwargs:
            raise ConfigError(
                "worker_extension_cls is set by HookedLLM (the probe lives there); "
                "remove it from the engine arguments"
            )
        if model is None:
            from guardrail.embedded import embedded_model_path

            model = embedded_model_path()
        self.model = str(model)
        self.config = self._resolve_config(probe_config)
        _check_sizes_from_files(self.model, self.config)
        from vllm import LLM

        processors = [*(engine_kwargs.pop("logits_processors", None) or []), STOP_PROCESSOR]
        self.llm = LLM(
            model=self.model,
            worker_extension_cls=WORKER_EXTENSION,
            logits_processors=processors,
            **engine_kwargs,
        )
        try:
            self._install(probe_heads)
        except BaseException:
            self.close()
            raise

    def _resolve_config(
        self, probe_config: ModelProbeConfig | str | Path | None
    ) -> ModelProbeConfig:
        if isinstance(probe_config, ModelProbeConfig):
            return probe_config
        if probe_config is not None:
            return read_model_config(probe_config)
        return load_model_config(self.model)

    def _install(self, probe_heads: Sequence[HeadKey] | str | None) -> None:
        info = self.llm.collective_rpc("guardrail_model_info")[0]
        self.model_info: dict[str, Any] = info
        if (
            "FULL" in info["cudagraph_mode"]
            and "DECODE_ONLY" not in info["cudagraph_mode"]
            and "PIECEWISE" not in info["cudagraph_mode"]
        ):
            raise EngineNotGuardableError(
                f"cudagraph_mode {info['cudagraph_mode']} replays prefill as a full CUDA graph, "
                "where "
                "the probe cannot run; use the default FULL_AND_PIECEWISE, PIECEWISE, or "
                "enforce_eager=True"
            )
        self.config.check_fits(info["num_layers"], info["num_heads"])
        if probe_heads == "all":
            heads = [
                (lay, h) for lay in range(info["num_layers"]) for h in range(info["num_heads"])
            ]
        elif probe_heads is not None:
            heads = [tuple(h) for h in probe_heads]  # type: ignore[misc]
            ModelProbeConfig(model_id="override", heads=heads).check_fits(
                info["num_layers"], info["num_heads"]
            )
        else:
            heads = list(self.config.heads)
        self.probe_heads: list[HeadKey] = heads
        try:
            self.llm.collective_rpc(
                "guardrail_install",
                args=([list(h) for h in heads], self.config.model_dump(mode="json")),
            )
        except ValueError as exc:
            raise EngineNotGuardableError(str(exc)) from exc
        self._self_test()

    def _self_test(self) -> None:
        """Refuse to run unguarded: one real request must come back scored."""
        out = self.generate([("Reply with OK.", "self test")], self._sampling(max_tokens=1))[0]
        if out.probe is None or out.probe.error is not None or out.probe.focus is None:
            reason = out.probe.error if out.probe else out.error
            raise EngineNotGuardableError(
                f"the probe did not fire in this engine configuration ({reason}); this happens "
                "when "
                "the attention implementation runs inside a captured graph. Start the engine with "
                "enforce_eager=True."
            )

    @staticmethod
    def _sampling(**kwargs: Any) -> Any:
        from vllm import SamplingParams

        return SamplingParams(**{"temperature": 0.0, **kwargs})

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def prepare(self, request: RequestLike) -> PreparedPrompt:
        """Render one request into token ids and spans (raises ``RequestError`` if invalid)."""
        max_len = self.llm.llm_engine.model_config.max_model_len
        return prepare_prompt(request, self.tokenizer, max_tokens=max_len)

    def generate(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        stop_below: float | Sequence[float | None] | None = None,
        stop_on_probe_error: bool | Sequence[bool] = True,
        probe_keys: Sequence[str | None] | None = None,
        steering: SteeringLike | Sequence[SteeringLike | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[GuardedOutput]:
        """Generate for each request with the probe on; one ``GuardedOutput`` per request, in order.

        ``stop_below`` (one value or one per request) ends a request right after its prefill,
        inside the engine, when its focus is at or below the value (or, with
        ``stop_on_probe_error``, when the probe failed): it decodes a single stop token and
        no more. An invalid request gets an output with ``error`` set and is not sent to the
        engine; the others are answered. A request whose score did not come back has
        ``probe.error`` set. ``probe_keys`` (one per request, None for a fresh uuid) chooses the
        key a request's score travels under, e.g. to aim ``set_probe_faults`` at one request.
        ``steering`` (one value or one per request, None = unsteered) steers requests with a
        loaded vector; their output's ``steering`` report says how many positions were steered,
        or why steering failed.
        """
        from vllm.inputs import TokensPrompt

        if isinstance(requests, str | tuple):
            raise ConfigError("generate() takes a list of requests; wrap a single one in a list")
        params = self._per_request_params(sampling_params, len(requests))
        stops = per_request(stop_below, len(requests), "stop_below")
        on_error = per_request(stop_on_probe_error, len(requests), "stop_on_probe_error")
        chosen_keys = self._probe_keys(probe_keys, len(requests))
        steer = self._steering_plan(steering, len(requests))
        steered = {}
        outputs: list[GuardedOutput | None] = [None] * len(requests)
        batch, batch_params, keys, indices = [], [], [], []
        for i, request in enumerate(requests):
            try:
                prepared = self.prepare(request)
            except GuardrailError as exc:
                outputs[i] = GuardedOutput(index=i, prompt=None, error=exc)
                continue
            key = chosen_keys[i] or uuid.uuid4().hex
            prompt = TokensPrompt(prompt_token_ids=prepared.token_ids)
            spec = prepared.probe_spec(key)
            if stops[i] is not None:
                spec.update(self._stop_spec(params[i], stops[i], bool(on_error[i])))
            batch_params.append(self._with_probe(params[i], spec))
            resolved = steer[i]
            if resolved is not None:  # never reuse KV cached without this steering
                prompt["cache_salt"] = resolved.cache_salt
                batch_params[-1].extra_args[STEER_ARG] = resolved.spec(key)
                steered[key] = resolved
            batch.append((prepared, prompt))
            keys.append(key)
            indices.append(i)
        if batch:
            try:
                results = self.llm.generate([p for _, p in batch], batch_params, use_tqdm=use_tqdm)
            finally:  # pop even on failure: a reused key must never find a stale score
                per_rank = self.llm.collective_rpc("guardrail_pop_results", args=(keys,))
                reports = self._steering_reports(steered)
            for (prepared, _), key, i, result in zip(batch, keys, indices, results, strict=True):
                output = self._output(i, prepared, result, _merge_rank_results(per_rank, key))
                outputs[i] = replace(output, steering=reports.get(key))
        return [o for o in outputs if o is not None]

    def _probe_keys(self, probe_keys: Sequence[str | None] | None, n: int) -> list[str | None]:
        keys = per_request(probe_keys, n, "probe_keys")
        given = [k for k in keys if k is not None]
        if any(not isinstance(k, str) or not k for k in given) or len(set(given)) != len(given):
            raise ConfigError(
                "probe_keys must be distinct non-empty strings (or None for a fresh "
                "key), one per request"
            )
        return keys

    def score(self, requests: Sequence[RequestLike]) -> list[GuardedOutput]:
        """Run the probe alone: prefill plus one sampled token, no text worth reading."""
        return self.generate(requests, self._sampling(max_tokens=1))

    def _per_request_params(self, sampling_params: Any, n: int) -> list[Any]:
        if sampling_params is None:
            return [self._sampling(max_tokens=64)] * n
        return per_request(sampling_params, n, "sampling params")

    def _stop_spec(self, params: Any, stop_below: float, on_error: bool) -> dict[str, Any]:
        if self.model_info["tp_size"] != 1:
            raise ConfigError(
                "early stop (stop_below) needs the whole probe on one rank; it is "
                "not supported with tensor_parallel_size > 1 yet"
            )
        if getattr(params, "min_tokens", 0):
            raise ConfigError("stop_below cannot end a request that sets min_tokens > 0")
        stop_token = self.tokenizer.eos_token_id
        if stop_token is None:
            raise ConfigError("the tokenizer has no eos token to end stopped requests with")
        return {
            "stop_below": float(stop_below),
            "stop_on_error": on_error,
            "stop_token": int(stop_token),
        }

    @staticmethod
    def _with_probe(params: Any, spec: dict[str, Any]) -> Any:
        params = params.clone()
        params.extra_args = {**(params.extra_args or {}), PROBE_ARG: spec}
        if "stop_token" in spec and spec["stop_token"] not in (params.stop_token_ids or []):
            params.stop_token_ids = [*(params.stop_token_ids or []), spec["stop_token"]]
        return params

    def _output(
        self, index: int, prepared: PreparedPrompt, result: Any, merged: dict[str, Any]
    ) -> GuardedOutput:
        completion = result.outputs[0]
        heads: dict[HeadKey, tuple[float, ...]] = merged["heads"]
        error = merged["error"]
        if error is None and not heads:
            error = "missing: the probe returned no score for this request"
        elif error is None and any(h not in heads for h in self.config.heads):
            error = "incomplete: some configured heads were not scored"
        focus = None if error else self.config.focus(heads)
        probe = ProbeResult(
            focus=focus,
            head_scores=head_focus(heads),
            head_stats=heads,
            error=error,
            num_prompt_tokens=merged["num_prompt_tokens"],
            probe_seconds=merged["seconds"],
            stopped=merged["stopped"],
        )
        return GuardedOutput(
            index=index,
            prompt=prepared,
            text=completion.text,
            token_ids=list(completion.token_ids),
            finish_reason=completion.finish_reason,
            num_cached_tokens=int(result.num_cached_tokens or 0),
            probe=probe,
        )

    def set_probe_faults(self, keys: Sequence[str]) -> None:
        """Testing hook: make the probe fail for requests whose probe key is in ``keys``."""
        self.llm.collective_rpc("guardrail_set_faults", args=(list(keys),))

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            shutdown = getattr(core, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None

    def __enter__(self) -> HookedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
