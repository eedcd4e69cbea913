"""Per-call guard state, carried in the call's ``RunnableConfig`` callbacks.

A ``GuardedRunnable`` call creates one ``GuardScope`` and adds it as an inheritable callback
handler to its child callback manager, so it travels in ``config["callbacks"]`` to every run
inside the chain and to nothing else (never on ``self``: batched and concurrent calls each have
their own). The scope captures the untrusted values as they flow through the chain (inputs and
outputs of any runnable under the named keys; optionally retrieved documents and tool outputs),
and the guarded models inside read it from their run manager to mark those values as data and to
record their verdicts.

Example:
    >>> scope = GuardScope(["context"])
    >>> scope.on_chain_start({}, {"context": "DOC", "question": "Why?"})
    >>> scope.untrusted_values()
    ['DOC']
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import LangChainException
from pydantic import BaseModel, ConfigDict

from guardrail.errors import PromptInjectionBlocked
from guardrail.policy import Policy
from guardrail.policy.verdict import Action, Verdict

from ._lc_marking import untrusted_strings

VERDICT_EVENT = "guardrail_verdict"
"""Name of the custom callback event a ``GuardedRunnable`` dispatches with its ``ChainVerdict``."""

logger = logging.getLogger("guardrail.integrations.langchain")


class ChainVerdict(BaseModel):
    """What a guarded chain decided: the strictest action over the verdicts of every guarded
    call inside it (block > retry > flag > allow), and those verdicts in the order they came.

    Example:
        >>> ChainVerdict(action=Action.ALLOW, reason="no guarded call").blocked
        False
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Action
    verdicts: tuple[Verdict, ...] = ()
    reason: str

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK

    @property
    def flagged(self) -> bool:
        return self.action is Action.FLAG

    @classmethod
    def from_verdicts(cls, verdicts: Sequence[Verdict]) -> ChainVerdict:
        """Combine verdicts (strictest action wins; the first verdict with it gives the reason).

        Example:
            >>> ChainVerdict.from_verdicts([]).reason
            'no guarded call ran in the chain'
        """
        if not verdicts:
            return cls(action=Action.ALLOW, reason="no guarded call ran in the chain")
        action = max((v.action for v in verdicts), key=lambda a: a.precedence)
        deciding = next(v for v in verdicts if v.action is action)
        reason = f"{len(verdicts)} guarded call(s); {deciding.request_id}: {deciding.reason}"
        return cls(action=action, verdicts=tuple(verdicts), reason=reason)


class GuardrailBlockedError(PromptInjectionBlocked, LangChainException):
    """A guardrail blocked a LangChain call: both a ``PromptInjectionBlocked`` (with
    ``.verdict``, the blocking verdict) and a ``LangChainException``, so
    ``.with_fallbacks(exceptions_to_handle=(GuardrailBlockedError,))`` catches it.

    ``verdicts`` holds every verdict of the guarded chain when a ``GuardedRunnable`` raised it
    (else the blocking one); ``report`` the chain-level ``ChainVerdict`` (None from a model).

    Example:
        >>> issubclass(GuardrailBlockedError, LangChainException)
        True
    """

    def __init__(
        self,
        message: str,
        verdict: Verdict | None,
        verdicts: Sequence[Verdict] = (),
        report: ChainVerdict | None = None,
    ) -> None:
        super().__init__(message, verdict)
        self.verdicts: tuple[Verdict, ...] = tuple(verdicts) or ((verdict,) if verdict else ())
        self.report = report

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.verdict, self.verdicts, self.report))


class GuardScope(BaseCallbackHandler):
    """One guarded call's state: untrusted keys and values, policies, collected verdicts.

    Runs inline (never in an executor) and raises its own errors, so a capture cannot silently
    fail and leave untrusted text unmarked. Thread-safe: branches of a ``RunnableParallel``
    run in threads and share the scope.
    """

    run_inline = True
    raise_error = True

    def __init__(
        self,
        keys: Iterable[str] = (),
        *,
        policies: tuple[Policy, ...] | None = None,
        retrieved_documents: bool = False,
        tool_outputs: bool = False,
    ) -> None:
        self.keys = tuple(keys)
        self.policies = policies
        self.retrieved_documents = retrieved_documents
        self.tool_outputs = tool_outputs
        self._lock = threading.Lock()
        self._values: dict[str, None] = {}  # an ordered set
        self._captures: list[tuple[str, ...]] = []  # the strings of each captured value
        self._marked: set[str] = set()
        self._verdicts: list[Verdict] = []

    # -- capture ---------------------------------------------------------------------------
    def add_values(self, value: Any) -> None:
        """Mark every string ``value`` can render as (see ``untrusted_strings``) untrusted."""
        strings = untrusted_strings(value)
        if not strings:
            return
        with self._lock:
            self._values.update(dict.fromkeys(strings))
            self._captures.append(tuple(strings))

    def capture(self, mapping: Any) -> None:
        """Capture the values of the untrusted keys from a runnable's input or output dict."""
        if isinstance(mapping, dict):
            for key in self.keys:
                if key in mapping:
                    self.add_values(mapping[key])

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.capture(inputs)

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.capture(outputs)

    def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        if self.retrieved_documents:
            for document in documents:
                self.add_values(document)

    def on_tool_end(self, output: Any, **kwargs: Any) -> None:
        if self.tool_outputs:
            self.add_values(getattr(output, "content", output))

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        """Nothing to capture (defined so LangChain does not fall back to ``on_llm_start``)."""

    # -- read and record -------------------------------------------------------------------
    def untrusted_values(self) -> list[str]:
        with self._lock:
            return list(self._values)

    def note_marked(self, values: Iterable[str]) -> None:
        with self._lock:
            self._marked.update(values)

    def record(self, verdict: Verdict) -> None:
        with self._lock:
            self._verdicts.append(verdict)

    def verdicts(self) -> list[Verdict]:
        with self._lock:
            return list(self._verdicts)

    def report(self, blocked: PromptInjectionBlocked | None = None) -> ChainVerdict:
        """The chain verdict so far (a block from outside the scope's models is included)."""
        verdicts = self.verdicts()
        extra = getattr(blocked, "verdict", None)
        if isinstance(extra, Verdict) and all(v is not extra for v in verdicts):
            verdicts.append(extra)
        with self._lock:
            # A value counts as marked when any form of it was (a list renders as its items or
            # as its str(), depending on the template).
            unmarked = [c[0] for c in self._captures if not self._marked.intersection(c)]
        if verdicts and unmarked:
            logger.warning(
                "%d untrusted value(s) never appeared in a guarded model's prompt, so the probe "
                "could not mark them as data (first: %.60r); check that the prompt inserts the "
                "value unchanged",
                len(unmarked),
                unmarked[0],
            )
        return ChainVerdict.from_verdicts(verdicts)


def scopes_of(run_manager: Any) -> list[GuardScope]:
    """The guard scopes a run belongs to, outermost first (empty outside any guard)."""
    handlers = getattr(run_manager, "handlers", None) or []
    return [h for h in handlers if isinstance(h, GuardScope)]


def scope_policies(scopes: Sequence[GuardScope]) -> tuple[Policy, ...] | None:
    """The policies of the innermost scope that sets some (None: the model's own policies)."""
    for scope in reversed(scopes):
        if scope.policies is not None:
            return scope.policies
    return None


class VerdictCollector(BaseCallbackHandler):
    """A callback handler that collects the ``ChainVerdict`` of every guarded chain it sees.

    Pass a fresh one per call, like any LangChain callback: it is how a chain whose output is a
    plain string (e.g. ends in ``StrOutputParser``) reports a flag.

    Example:
        >>> collector = VerdictCollector()
        >>> answer = guarded_chain.invoke(inputs, {"callbacks": [collector]})  # doctest: +SKIP
        >>> collector.reports[0].action  # doctest: +SKIP
        <Action.FLAG: 'flag'>
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reports: list[ChainVerdict] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        if name == VERDICT_EVENT:
            with self._lock:
                self.reports.append(ChainVerdict.model_validate(data))
