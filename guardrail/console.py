"""Console applications (the ``guardrail`` CLI, ``guardrail-serve``, the examples, the demo): show
the library's own output, keep vLLM's start-up and shutdown logs behind ``--verbose``, and help
text that states every option's default.

Nothing here runs on import: an application calls ``quiet_engine_logs`` once, before it starts
an engine. vLLM reads its log level from the environment when it is first imported, and its
engine processes inherit the environment, so this sets ``VLLM_LOGGING_LEVEL`` (unless the user
set it) and filters the deprecation noise torch and vLLM print on CPU.

Example:
    >>> quiet_engine_logs(verbose=True)  # leaves everything as it is
"""

from __future__ import annotations

import argparse
import logging
import os
import textwrap
import warnings

__all__ = ["HelpFormatter", "StatedDefaultsFormatter", "quiet_engine_logs", "status"]


def quiet_engine_logs(verbose: bool = False) -> None:
    """Quiet vLLM, torch and transformers unless ``verbose``; call before starting an engine."""
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ warnings (engine processes)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # inherited by the engine
    for noisy in ("vllm", "torch", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(vllm|torch|transformers)")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(vllm|torch)")


def status(message: str) -> None:
    """One progress line on stderr (kept apart from the results on stdout)."""
    import sys

    print(f"... {message}", file=sys.stderr, flush=True)


class StatedDefaultsFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, unless the help states it already.

    A value default is appended as ``(default: VALUE)``, a flag's as ``(default: off)``. An option
    whose help already says ``(default ...`` keeps its own words: that is how an option whose
    default is None says what leaving it out means (a None default is never printed as "None"),
    and how one whose default is read from the environment (a key, maybe) keeps its value out of
    ``--help``. Put it before an ``argparse.ArgumentDefaultsHelpFormatter`` (or a subclass, such
    as vLLM's) in the bases.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.required or action.default in (None, argparse.SUPPRESS):
            return text
        if action.nargs == 0 and action.default is False:  # store_true and friends
            return f"{text} (default: off)"
        return super()._get_help_string(action)


class HelpFormatter(StatedDefaultsFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of this library's commands: every option's default stated
    (:class:`StatedDefaultsFormatter`), no line broken inside a ``--flag-name``, and in
    descriptions and epilogs, paragraphs re-wrapped while lines that start with a space (a
    schema, an example) are kept as written.

    Example:
        >>> parser = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
        >>> _ = parser.add_argument("--port", type=int, default=8000, help="port")
        >>> "port (default: 8000)" in parser.format_help()
        True
    """

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        filled = []
        for block in text.strip("\n").split("\n\n"):
            lines = block.splitlines()
            if any(line.startswith(" ") for line in lines):
                filled.append("\n".join(indent + line for line in lines))
            else:
                filled.append(
                    textwrap.fill(
                        " ".join(block.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
        return "\n\n".join(filled)
