"""``HookedLLM``: a vLLM engine whose Attention Tracker probe runs inside the real generation.

One pass: the probe reads attention during the prefill of the request's own generation (no
extra probe pass), computes per-head focus scores inside the worker on the model's device, and
returns a few numbers per request. The caller-side work here is rendering prompts into token
spans, attaching each request's probe spec (``ProbeClient``), and matching results back by the
key it carries. Steering is a component (``SteeringClient``) this engine holds.

Example:
    >>> with HookedLLM(dtype="float32") as llm:  # doctest: +SKIP
    ...     out = llm.generate([("Summarize the email.", "Hi, lunch at noon?")])[0]
    ...     print(out.probe.focus, out.text)
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from guardrail.engine.client import ProbeClient, check_probe_keys
from guardrail.engine.steering import ResolvedSteering, SteeringClient
from guardrail.engine.types import GuardedOutput, ProbeResult, per_request
from guardrail.errors import ConfigError, EngineNotGuardableError, GuardrailError
from guardrail.probe.config import ModelProbeConfig, resolve_config
from guardrail.probe.prompts import PreparedPrompt, RequestLike, prepare_prompt
from guardrail.probe.scoring import HeadKey
from guardrail.protocol import (
    RPC_INSTALL,
    RPC_MODEL_INFO,
    RPC_POP_RESULTS,
    RPC_SET_FAULTS,
    STEER_ARG,
    STOP_PROCESSOR,
    WORKER_EXTENSION,
    ModelInfo,
)
from guardrail.steering import SteeringVector
from guardrail.steering.spec import SteeringLike

__all__ = ["GuardedOutput", "HookedLLM", "ProbeResult", "per_request"]


def _check_sizes_from_files(model: str, config: ModelProbeConfig) -> None:
    """Fail before the engine starts when a local model's config.json shows the heads do not fit."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return  # a hub id: checked against the loaded model after start
    hf = json.loads(config_file.read_text())
    hf = hf.get("text_config", hf)
    if "num_hidden_layers" in hf and "num_attention_heads" in hf:
        config.check_fits(int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]))


def _refuse_full_cudagraph(info: ModelInfo) -> None:
    mode = info["cudagraph_mode"]
    if "FULL" in mode and "DECODE_ONLY" not in mode and "PIECEWISE" not in mode:
        raise EngineNotGuardableError(
            f"cudagraph_mode {mode} replays prefill as a full CUDA graph, where the probe "
            "cannot run; use the default FULL_AND_PIECEWISE, PIECEWISE, or enforce_eager=True"
        )


class HookedLLM:
    """A ``vllm.LLM`` with the guardrail probe installed in its workers (a ``GuardEngine``).

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
        self.config = resolve_config(self.model, probe_config)
        _check_sizes_from_files(self.model, self.config)
        from vllm import LLM

        processors = [*(engine_kwargs.pop("logits_processors", None) or []), STOP_PROCESSOR]
        self.llm: Any = LLM(
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

    def _install(self, probe_heads: Sequence[HeadKey] | str | None) -> None:
        info: ModelInfo = self.llm.collective_rpc(RPC_MODEL_INFO)[0]
        self.model_info = info
        _refuse_full_cudagraph(info)
        self.config.check_fits(info["num_layers"], info["num_heads"])
        if probe_heads == "all":
            heads = [
                (lay, h) for lay in range(info["num_layers"]) for h in range(info["num_heads"])
            ]
        elif probe_heads is not None:
            heads = [(int(h[0]), int(h[1])) for h in probe_heads]
            ModelProbeConfig(model_id="override", heads=heads).check_fits(
                info["num_layers"], info["num_heads"]
            )
        else:
            heads = list(self.config.heads)
        self.probe_heads: list[HeadKey] = heads
        self.probe = ProbeClient(
            self.config, tp_size=info["tp_size"], stop_token=self.tokenizer.eos_token_id
        )
        self.steering = SteeringClient(self.llm, self.config.model_id, info, self.prepare)
        try:
            self.llm.collective_rpc(
                RPC_INSTALL, args=([list(h) for h in heads], self.config.model_dump(mode="json"))
            )
        except ValueError as exc:
            raise EngineNotGuardableError(str(exc)) from exc
        self._self_test()

    def _self_test(self) -> None:
        """Refuse to run unguarded: one real request must come back scored."""
        out = self.generate([("Reply with OK.", "self test")], self.sampling(max_tokens=1))[0]
        if out.probe is None or out.probe.error is not None or out.probe.focus is None:
            reason = out.probe.error if out.probe else out.error
            raise EngineNotGuardableError(
                f"the probe did not fire in this engine configuration ({reason}); this happens "
                "when the attention implementation runs inside a captured graph. Start the "
                "engine with enforce_eager=True."
            )

    @staticmethod
    def sampling(**kwargs: Any) -> Any:
        """vLLM ``SamplingParams`` with greedy decoding unless ``kwargs`` say otherwise."""
        from vllm import SamplingParams

        return SamplingParams(**{"temperature": 0.0, **kwargs})

    @property
    def stop_token(self) -> int | None:
        """The token an early-stopped request ends with (the tokenizer's eos)."""
        return self.probe.stop_token

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
        n = len(requests)
        params = self._per_request_params(sampling_params, n)
        stops = per_request(stop_below, n, "stop_below")
        on_error = per_request(stop_on_probe_error, n, "stop_on_probe_error")
        chosen_keys = per_request(probe_keys, n, "probe_keys")
        check_probe_keys(chosen_keys)
        steer = self.steering.plan(steering, n)
        steered: dict[str, ResolvedSteering] = {}
        outputs: list[GuardedOutput | None] = [None] * n
        prompts, batch_params, sent = [], [], []
        for i, request in enumerate(requests):
            try:
                prepared = self.prepare(request)
            except GuardrailError as exc:
                outputs[i] = GuardedOutput(index=i, prompt=None, error=exc)
                continue
            key = chosen_keys[i] or uuid.uuid4().hex
            spec = self.probe.spec(prepared, key, params[i], stops[i], bool(on_error[i]))
            batch_params.append(self.probe.attach(params[i], spec))
            prompt = TokensPrompt(prompt_token_ids=prepared.token_ids)
            resolved = steer[i]
            if resolved is not None:  # never reuse KV cached without this steering
                prompt["cache_salt"] = resolved.cache_salt
                batch_params[-1].extra_args[STEER_ARG] = resolved.spec(key)
                steered[key] = resolved
            prompts.append(prompt)
            sent.append((i, prepared, key))
        if sent:
            try:
                results = self.llm.generate(prompts, batch_params, use_tqdm=use_tqdm)
            finally:  # pop even on failure: a reused key must never find a stale score
                per_rank = self.llm.collective_rpc(RPC_POP_RESULTS, args=([k for *_, k in sent],))
                reports = self.steering.reports(steered)
            for (i, prepared, key), result in zip(sent, results, strict=True):
                completion = result.outputs[0]
                outputs[i] = GuardedOutput(
                    index=i,
                    prompt=prepared,
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    finish_reason=completion.finish_reason,
                    num_cached_tokens=int(result.num_cached_tokens or 0),
                    probe=self.probe.result(per_rank, key),
                    steering=reports.get(key),
                )
        return [o for o in outputs if o is not None]

    def score(self, requests: Sequence[RequestLike]) -> list[GuardedOutput]:
        """Run the probe alone: prefill plus one sampled token, no text worth reading."""
        return self.generate(requests, self.sampling(max_tokens=1))

    def _per_request_params(self, sampling_params: Any, n: int) -> list[Any]:
        if sampling_params is None:
            return [self.sampling(max_tokens=64)] * n
        return per_request(sampling_params, n, "sampling params")

    def set_probe_faults(self, keys: Sequence[str]) -> None:
        """Testing hook: make the probe fail for requests whose probe key is in ``keys``."""
        self.llm.collective_rpc(RPC_SET_FAULTS, args=(list(keys),))

    # -- steering (the ``steering`` component; these are its public face) -----------------------
    @property
    def steering_vectors(self) -> dict[str, SteeringVector]:
        """The vectors loaded in the workers, by name."""
        return self.steering.vectors

    def load_steering_vector(self, vector: str | Path | SteeringVector) -> SteeringVector:
        """Validate a vector against the served model and load it in the workers (by name)."""
        return self.steering.load(vector)

    def unload_steering_vector(self, name: str | None = None) -> None:
        """Remove one vector (or all, with None)."""
        self.steering.unload(name)

    @contextlib.contextmanager
    def steering_vector(self, vector: str | Path | SteeringVector) -> Iterator[SteeringVector]:
        """Load a vector for the ``with`` block (see ``SteeringClient.vector``)."""
        with self.steering.vector(vector) as loaded:
            yield loaded

    def continuation_logprobs(
        self,
        requests: Sequence[RequestLike],
        continuations: Sequence[str],
        steering: SteeringLike | Sequence[SteeringLike | None] | None = None,
    ) -> list[list[float]]:
        """Teacher-forced log-probabilities of continuations (``SteeringClient``)."""
        return self.steering.continuation_logprobs(requests, continuations, steering)

    def capture_residuals(
        self, requests: Sequence[RequestLike], layers: Sequence[int]
    ) -> list[dict[int, torch.Tensor]]:
        """The residual stream at each request's last prompt token (``SteeringClient``)."""
        return self.steering.capture_residuals(requests, layers)

    # -- lifecycle -------------------------------------------------------------------------------
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
