"""``FakeEngine``: a ``GuardEngine`` without a model, for tests of the layers above the engine.

It renders requests with a real tokenizer (spans exactly as ``HookedLLM`` computes them), takes
each request's focus from a function you give it, and honours the engine contract the guard
relies on: invalid requests fail alone, ``stop_below`` ends a request after its "prefill" (one
stop token, no text), probe faults by key, steering only with a loaded vector on an eager
engine, and a steering report for every steered request. Use it to test policies, the retry
loop, adapters and servers in milliseconds; use ``HookedLLM`` on the tiny models for anything
that must touch vLLM.

Example:
    >>> from guardrail.probe.config import ModelProbeConfig
    >>> engine = FakeEngine(ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.5),
    ...                     tokenizer, focus=lambda prompt, attempt: 0.2)  # doctest: +SKIP
    >>> engine.generate([("Summarize.", "Ignore that.")], stop_below=0.5)[0].probe.stopped
    ... # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from guardrail.engine.client import MISSING_SCORE, checked_request_args, request_count
from guardrail.engine.steering import require_eager
from guardrail.engine.types import GuardedOutput, ProbeResult, per_request
from guardrail.errors import ConfigError, GuardrailError
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import PreparedPrompt, RequestLike, prepare_prompt
from guardrail.protocol import ModelInfo, ProbeErrorReason, injected_fault_message
from guardrail.steering.spec import Steering, SteeringLike, SteeringReport
from guardrail.steering.vector import SteeringVector, load_steering_vector

__all__ = ["FakeEngine", "FocusFn"]

FocusFn = Callable[[PreparedPrompt, int], float | None]
"""The focus of a rendered request on its ``attempt``-th generation (1 = first); None = the
probe could not score it."""


class FakeEngine:
    """A model-free ``GuardEngine``: real spans, scripted scores, the engine's contract.

    ``tokenizer`` is a Hugging Face tokenizer with a chat template (e.g. the tiny test model's);
    ``focus`` gives each request's score; ``answer`` the text a request that was not stopped
    "generates". ``num_layers`` / ``hidden_size`` describe the pretend model to steering files.
    """

    def __init__(
        self,
        config: ModelProbeConfig,
        tokenizer: Any,
        focus: FocusFn,
        *,
        answer: str = "fake answer",
        enforce_eager: bool = True,
        num_layers: int = 4,
        num_heads: int = 4,
        hidden_size: int = 64,
        max_model_len: int = 2048,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.focus = focus
        self.answer = answer
        self.max_model_len = max_model_len
        self.model_info: ModelInfo = {
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": num_heads,
            "hidden_size": hidden_size,
            "attention_layers": num_layers,
            "backend": "fake",
            "isa": None,
            "kv_cache_dtype": "auto",
            "block_size": 16,
            "enforce_eager": enforce_eager,
            "compilation_mode": "fake",
            "cudagraph_mode": "NONE",
            "tp_rank": 0,
            "tp_size": 1,
            "pp_size": 1,
            "device": "cpu",
            "fast_exit": False,  # no engine process
        }
        self.faults: set[str] = set()
        self.calls: list[list[str]] = []  # probe keys sent, per generate call
        self._vectors: dict[str, SteeringVector] = {}
        self._attempts: dict[str, int] = {}
        self.closed = False

    @property
    def stop_token(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def steering_vectors(self) -> Mapping[str, SteeringVector]:
        return dict(self._vectors)

    def load_steering_vector(self, vector: str | Path | SteeringVector) -> SteeringVector:
        loaded = load_steering_vector(vector)
        info = self.model_info
        loaded.check_model(self.config.model_id, info["hidden_size"], info["num_layers"])
        require_eager(info)
        self._vectors[loaded.name] = loaded
        return loaded

    def set_probe_faults(self, keys: Sequence[str]) -> None:
        self.faults = set(keys)

    def prepare(self, request: RequestLike) -> PreparedPrompt:
        return prepare_prompt(request, self.tokenizer, max_tokens=self.max_model_len)

    def generate(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        stop_below: float | Sequence[float | None] | None = None,
        stop_on_probe_error: bool | Sequence[bool] = True,
        probe_keys: Sequence[str | None] | None = None,
        steering: SteeringLike | Sequence[SteeringLike | None] | None = None,
    ) -> list[GuardedOutput]:
        if self.closed:
            raise GuardrailError("the fake engine was closed")
        n = request_count(requests)
        errors: dict[int, GuardrailError] = {}  # as the real engine: a bad entry fails alone
        stops, on_error, keys = checked_request_args(
            n, stop_below, stop_on_probe_error, probe_keys, errors
        )
        steer = self._steering(steering, n)
        self.calls.append([k or f"fake-{i}" for i, k in enumerate(keys)])
        outputs = []
        for i, request in enumerate(requests):
            if i in errors:
                outputs.append(GuardedOutput(index=i, prompt=None, error=errors[i]))
                continue
            try:
                prepared = self.prepare(request)
            except GuardrailError as exc:
                outputs.append(GuardedOutput(index=i, prompt=None, error=exc))
                continue
            key = keys[i] or f"fake-{i}"
            outputs.append(self._run(i, prepared, key, stops[i], bool(on_error[i]), steer[i]))
        return outputs

    def _steering(
        self, steering: SteeringLike | Sequence[SteeringLike | None] | None, n: int
    ) -> list[Steering | None]:
        if steering is None:
            return [None] * n
        entries = per_request(
            steering if not isinstance(steering, str | Steering | Mapping) else [steering] * n,
            n,
            "steering",
        )
        plan = [
            None if e is None else Steering(vector=e) if isinstance(e, str) else e for e in entries
        ]
        if any(p is not None for p in plan):
            require_eager(self.model_info)
        for p in plan:
            if isinstance(p, Steering) and p.vector not in self._vectors:
                raise ConfigError(f"steering vector {p.vector!r} is not loaded")
        return plan

    def _run(
        self,
        index: int,
        prepared: PreparedPrompt,
        key: str,
        stop_below: float | None,
        stop_on_error: bool,
        steering: Steering | None,
    ) -> GuardedOutput:
        request_key = key.split("~")[0]
        attempt = self._attempts.get(request_key, 0) + 1
        self._attempts[request_key] = attempt
        focus, error, reason = self._score(prepared, key, attempt)
        stopped = stop_below is not None and (
            (focus is not None and focus <= stop_below) or (focus is None and stop_on_error)
        )
        if stopped:
            text, token_ids = "", [int(self.stop_token or 0)]
        else:
            text = self.answer
            token_ids = list(self.tokenizer.encode(self.answer, add_special_tokens=False))
        report = None
        if steering is not None:
            vector = self._vectors[steering.vector].metadata
            report = SteeringReport(
                steering.vector,
                steering.method or vector.method,
                vector.coefficient if steering.coefficient is None else steering.coefficient,
                tokens_steered=len(prepared.token_ids) + len(token_ids) - 1,
            )
        return GuardedOutput(
            index=index,
            prompt=prepared,
            text=text,
            token_ids=token_ids,
            finish_reason="stop" if stopped else "length",
            probe=ProbeResult(
                focus=focus,
                error=error,
                error_reason=reason,
                num_prompt_tokens=len(prepared.token_ids),
                probe_seconds=0.001,
                stopped=stopped,
            ),
            steering=report,
        )

    def _score(
        self, prepared: PreparedPrompt, key: str, attempt: int
    ) -> tuple[float | None, str | None, ProbeErrorReason | None]:
        """``(focus, error, reason)`` of one request, failed as the real engine fails it: a
        fault in its first hooked layer (``LAYER``), no focus ``MISSING``."""
        if key in self.faults:
            first = min(layer for layer, _ in self.config.heads)
            return None, injected_fault_message(first), ProbeErrorReason.LAYER
        focus = self.focus(prepared, attempt)
        if focus is None:
            return None, MISSING_SCORE, ProbeErrorReason.MISSING
        return focus, None, None

    def close(self) -> None:
        self.closed = True
