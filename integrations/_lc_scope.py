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
    """What a guarded chain decided, over the verdicts of every guarded call inside it (in the
    order they came).

    ``action`` is what the guard did with the chain's output:

    - ``block``: the guard stopped the chain. A guarded call's block reached the guard, which
      raised ``GuardrailBlockedError`` or returned its refusal; nothing of the chain's own
      answer was delivered.
    - ``flag``: the chain's output was delivered and needs a look: a guarded call was flagged,
      or a guarded call was **blocked and the chain handled the block itself** (a
      ``with_fallbacks`` model, a nested guard's refusal, an ``except`` in a step) and answered
      anyway. That last case sets ``fell_back``: the output is the fallback's answer, and the
      blocked verdict is in ``verdicts``.
    - ``allow``: every guarded call was allowed (or none ran).

    Example:
        >>> ChainVerdict(action=Action.ALLOW, reason="no guarded call").blocked
        False
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Action
    verdicts: tuple[Verdict, ...] = ()
    reason: str
    fell_back: bool = False
    """A guarded call was blocked inside the chain, which handled it and answered anyway."""

    @property
    def blocked(self) -> bool:
        """The guard blocked the chain (it raised or refused)."""
        return self.action is Action.BLOCK

    @property
    def flagged(self) -> bool:
        """The output was delivered with a flag (a flagged call, or a fallback after a block)."""
        return self.action is Action.FLAG

    @classmethod
    def from_verdicts(
        cls, verdicts: Sequence[Verdict], *, chain_answered: bool = False
    ) -> ChainVerdict:
        """Combine verdicts: the strictest action wins and the first verdict with it gives the
        reason. With ``chain_answered`` (the chain returned an output although a call inside it
        was blocked, i.e. the chain handled the block), the action is ``flag`` and
        ``fell_back`` is set.

        Example:
            >>> ChainVerdict.from_verdicts([]).reason
            'no guarded call ran in the chain'
        """
        if not verdicts:
            return cls(action=Action.ALLOW, reason="no guarded call ran in the chain")
        action = max((v.action for v in verdicts), key=lambda a: a.precedence)
        deciding = next(v for v in verdicts if v.action is action)
        calls = f"{len(verdicts)} guarded call(s)"
        if action is Action.BLOCK and chain_answered:
            blocked = sum(v.action is Action.BLOCK for v in verdicts)
            reason = (
                f"{calls}; {blocked} blocked inside the chain, which handled the block and "
                f"answered with its fallback; {deciding.request_id}: {deciding.reason}"
            )
            return cls(action=Action.FLAG, verdicts=tuple(verdicts), reason=reason, fell_back=True)
        reason = f"{calls}; {deciding.request_id}: {deciding.reason}"
        if action is Action.BLOCK:
            reason = f"{calls}; blocked by the guard; {deciding.request_id}: {deciding.reason}"
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
        # The strings of each captured value, by source (an input key, "retrieved documents",
        # "tool outputs"): one source counts once in the "never marked" warning.
        self._captures: dict[str, dict[tuple[str, ...], None]] = {}
        self._marked: set[str] = set()
        self._verdicts: list[Verdict] = []
        self._seen_keys: dict[str, None] = {}  # every dict key seen flowing through the chain

    # -- capture ---------------------------------------------------------------------------
    def add_values(self, value: Any, source: str = "value") -> None:
        """Mark every string ``value`` can render as (see ``untrusted_strings``) untrusted;
        ``source`` names where it came from (an input key) for the warning of ``report``."""
        strings = untrusted_strings(value)
        if not strings:
            return
        with self._lock:
            self._values.update(dict.fromkeys(strings))
            self._captures.setdefault(source, {})[tuple(strings)] = None

    def capture(self, mapping: Any) -> None:
        """Capture the values of the untrusted keys from a runnable's input or output dict."""
        if not isinstance(mapping, dict):
            return
        with self._lock:
            self._seen_keys.update(dict.fromkeys(k for k in mapping if isinstance(k, str)))
        for key in self.keys:
            if key in mapping:
                self.add_values(mapping[key], key)

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.capture(inputs)

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.capture(outputs)

    def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        if self.retrieved_documents:
            for document in documents:
                self.add_values(document, "retrieved documents")

    def on_tool_end(self, output: Any, **kwargs: Any) -> None:
        if self.tool_outputs:
            self.add_values(getattr(output, "content", output), "tool outputs")

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        """Nothing to capture (defined so LangChain does not fall back to ``on_llm_start``)."""

    # -- read and record -------------------------------------------------------------------
    def untrusted_values(self) -> list[str]:
        with self._lock:
            return list(self._values)

    def seen_keys(self) -> list[str]:
        """Every dict key seen so far in the guard's input and in any step's input or output."""
        with self._lock:
            return list(self._seen_keys)

    def note_marked(self, values: Iterable[str]) -> None:
        with self._lock:
            self._marked.update(values)

    def record(self, verdict: Verdict) -> None:
        with self._lock:
            self._verdicts.append(verdict)

    def verdicts(self) -> list[Verdict]:
        with self._lock:
            return list(self._verdicts)

    def unmarked(self) -> dict[str, str]:
        """Sources (input keys, ...) with a captured value no guarded prompt contained, each
        with the first such value. A value counts as marked when any form of it was (a list
        renders as its items or as its str(), depending on the template)."""
        with self._lock:
            found: dict[str, str] = {}
            for source, captures in self._captures.items():
                missing = [c[0] for c in captures if not self._marked.intersection(c)]
                if missing:
                    found[source] = missing[0]
            return found

    def report(self, blocked: PromptInjectionBlocked | None = None) -> ChainVerdict:
        """The chain verdict: ``blocked`` is the block that reached the guard (None when the
        chain answered; a block among the verdicts was then handled inside the chain). A block
        from outside the scope's models (e.g. a nested guard) is included."""
        verdicts = self.verdicts()
        extra = getattr(blocked, "verdict", None)
        if isinstance(extra, Verdict) and all(v is not extra for v in verdicts):
            verdicts.append(extra)
        unmarked = self.unmarked()
        if verdicts and unmarked:
            first = next(iter(unmarked.items()))
            logger.warning(
                "%d untrusted input(s) (%s) had a value that never appeared unchanged in a "
                "guarded model's prompt, so the probe could not mark it as data (%s: %.60r); "
                "check that the prompt inserts the value unchanged",
                len(unmarked),
                ", ".join(map(repr, unmarked)),
                *first,
            )
        return ChainVerdict.from_verdicts(verdicts, chain_answered=blocked is None)


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
