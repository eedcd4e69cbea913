"""``guardrail-serve``'s entry point: ``--help`` and ``--version`` are answered from the server's
own options before vLLM or torch is imported (seconds); any other command line starts the
server (``serving.main``).

Example:
    >>> main(["--version"])  # doctest: +SKIP
    guardrail-serve 0.1.0
"""

from __future__ import annotations

import sys

from ._serve_args import own_parser

__all__ = ["main"]

_ANSWERED_HERE = frozenset({"-h", "--help", "--version"})


def main(argv: list[str] | None = None) -> None:
    """``guardrail-serve``: ``--help`` and ``--version`` at once; otherwise start the server."""
    command = sys.argv[1:] if argv is None else argv
    if _ANSWERED_HERE.intersection(command):
        own_parser().parse_known_args(command)  # prints and exits
    from .serving import main as serve  # vLLM, torch, FastAPI: only to serve

    serve(command)


if __name__ == "__main__":
    main()
