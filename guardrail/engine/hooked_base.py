"""What the sync ``HookedLLM`` and the ``AsyncHookedLLM`` share once vLLM runs: the probe's
installation (``ProbeInstall``: checked against the served model, sent to the workers, kept by
the engine), greedy sampling params, and the facts the guard reads (``stop_token``,
``tokenizer``). Each engine adds only how it talks to vLLM: a call under its lock, or an
``await``.

Example:
    >>> from guardrail.engine.async_hooked import AsyncHookedLLM
    >>> from guardrail.engine.hooked import HookedLLM
    >>> issubclass(HookedLLM, HookedBase) and issubclass(AsyncHookedLLM, HookedBase)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from guardrail.engine.client import ProbeClient
from guardrail.engine.inbox import ResultInbox
from guardrail.engine.install import check_served_model, heads_to_score
from guardrail.errors import EngineNotGuardableError
from guardrail.probe.config import DATA_POSITIONS, ModelProbeConfig
from guardrail.probe.scoring import HeadKey
from guardrail.protocol import NOT_GUARDABLE, ModelInfo

__all__ = ["HookedBase", "ProbeInstall", "refused_as_not_guardable"]


@dataclass(frozen=True)
class ProbeInstall:
    """One installation of the probe: ``rpc_args`` go to ``RPC_INSTALL``; ``reset_prefix_cache``
    says whether the engine's prefix cache must be emptied after it (the data-mean memo starts
    empty, so no cached block may predate it); the rest the engine keeps."""

    heads: list[HeadKey]
    hidden_layers: list[int]
    data_mean_layers: list[int]
    client: ProbeClient
    rpc_args: tuple[Any, ...]
    reset_prefix_cache: bool


@contextlib.contextmanager
def refused_as_not_guardable() -> Iterator[None]:
    """The workers refuse a probe they cannot install (e.g. a quantized KV cache) with a
    message starting with ``NOT_GUARDABLE``: a ``ValueError`` in an in-process engine, a plain
    ``Exception`` from vLLM's engine core otherwise. That engine is not guardable."""
    try:
        yield
    except Exception as exc:
        message = str(exc)
        at = message.find(NOT_GUARDABLE)
        if at < 0 and not isinstance(exc, ValueError):
            raise
        reason = message[at + len(NOT_GUARDABLE) :] if at >= 0 else message
        raise EngineNotGuardableError(reason) from exc


class HookedBase:
    """The state and facts both hooked engines share (see the module docstring)."""

    model: str
    config: ModelProbeConfig
    model_info: ModelInfo
    probe: ProbeClient
    probe_heads: list[HeadKey]
    probe_hidden_layers: list[int]
    probe_data_mean_layers: list[int]
    _tokenizer: Any
    _inbox: ResultInbox | None = None  # where the workers push results (None: they are popped)
    chat_template: str | None = None
    """The Jinja chat template every request is rendered with, as ``vllm serve --chat-template``
    (None: the tokenizer's own); set it before the first request. It is passed to each render,
    not set on the tokenizer: vLLM's tokenizer renders on copies of itself made at start-up."""

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
        return self._tokenizer

    def _plan_install(
        self,
        info: ModelInfo,
        probe_heads: Sequence[HeadKey] | str | None,
        hidden_layers: Sequence[int],
        data_mean_layers: Sequence[int],
    ) -> ProbeInstall:
        """Check the served model (``info``) against the config, choose the heads to score, and
        keep what the engine needs to read results (``probe``, ``probe_heads``, the layers); the
        installation to send. Arguments are those of the engines' constructors."""
        self.model_info = info
        check_served_model(info, self.config, self.model)  # sizes must match; another id warns
        raw_hidden = [int(layer) for layer in hidden_layers]
        raw_means = [int(layer) for layer in data_mean_layers]
        heads = heads_to_score(self.config, info, probe_heads)
        install = ProbeInstall(
            heads=heads,
            hidden_layers=sorted(set(raw_hidden)),
            data_mean_layers=sorted(set(raw_means)),
            client=ProbeClient(
                self.config,
                tp_size=info["tp_size"],
                pp_size=info["pp_size"],
                stop_token=self._tokenizer.eos_token_id,
            ),
            rpc_args=(
                [list(h) for h in heads],
                self.config.model_dump(mode="json"),
                raw_hidden,
                raw_means,
            ),
            reset_prefix_cache=bool(
                raw_means or any(self.config.hidden_layers_at(p) for p in DATA_POSITIONS)
            ),
        )
        self.probe_heads = install.heads
        self.probe_hidden_layers = install.hidden_layers
        self.probe_data_mean_layers = install.data_mean_layers
        self.probe = install.client
        return install
