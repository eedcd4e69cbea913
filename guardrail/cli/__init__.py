"""The ``guardrail`` command: check, calibrate, evaluate, split, crop, threshold and steer.

Subcommands live in a registry (:data:`SUBCOMMANDS`), each a name, a help line, a function
adding its arguments and a function running it; add one with :func:`register`. Each has its
own module here (``calibrate``, ``evaluate``, ``threshold``, ``rows``, ``steer``); the arguments
they share, and the library's typed settings built from them, are in ``options``. The work
itself (scoring rows through the score cache, fitting, the steering build) is the library's,
in ``guardrail.offline``.

    guardrail check --engine-arg enforce_eager=false                   # what an engine runs
    guardrail calibrate --out my_configs/            # embedded SmolLM2, the packaged pool
    guardrail calibrate --out model_configs/         # rebuilds the shipped SmolLM2 configs
    guardrail evaluate --config model_configs/X.json --data pairs.jsonl --out-dir results/
    guardrail threshold --config model_configs/X.json --data my_clean.jsonl --out mine.json

Head scores come from the serving probe itself (every head of every layer in calibration
mode), so calibration and serving measure the same thing. ``--scores-cache`` keeps them in an
``.npz`` file so a second run (or ``evaluate`` after ``calibrate``) does not re-run the model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from guardrail.cli import calibrate, check, evaluate, rows, steer, threshold
from guardrail.cli.evaluate import load_detectors
from guardrail.console import HelpFormatter, quiet_engine_logs
from guardrail.errors import GuardrailError
from guardrail.offline.row_scores import score_pairs, scores_for

__all__ = [
    "SUBCOMMANDS",
    "Subcommand",
    "build_parser",
    "load_detectors",
    "main",
    "register",
    "score_pairs",
    "scores_for",
]


@dataclass(frozen=True)
class Subcommand:
    """One ``guardrail`` subcommand: ``run(args, engine)`` returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Any], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(command: Subcommand) -> Subcommand:
    """Add a subcommand to the ``guardrail`` CLI (names are unique)."""
    if command.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {command.name!r} is already registered")
    SUBCOMMANDS[command.name] = command
    return command


def _description() -> str:
    names = ", ".join(SUBCOMMANDS)
    return (
        f"In-model prompt-injection guardrails: offline tools ({names}). On CPU, commands "
        "that start an engine set VLLM_CPU_KVCACHE_SPACE=2, VLLM_HOST_IP=127.0.0.1 and "
        "dtype float32 unless already set."
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per registered subcommand."""
    from guardrail.version import __version__

    parser = argparse.ArgumentParser(
        prog="guardrail", description=_description(), formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS.values():
        sub = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            formatter_class=HelpFormatter,
        )
        sub.add_argument("--verbose", action="store_true", help="show vLLM's own logs too")
        command.configure(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, engine: Any = None) -> int:
    """Entry point of the console script; ``engine`` reuses a started ``HookedLLM`` (tests).

    Example:
        >>> main(["calibrate", "--data", "pairs.jsonl", "--out", "configs/"])  # doctest: +SKIP
        0
    """
    args = build_parser().parse_args(argv)
    quiet_engine_logs(args.verbose)
    try:
        return SUBCOMMANDS[args.command].run(args, engine)
    except GuardrailError as exc:
        print(f"guardrail {args.command}: error: {exc}", file=sys.stderr)
        return 2


register(
    Subcommand(
        "check",
        "start the guarded engine these arguments describe and print what it runs: attention "
        "backend, dtype, graph mode, probe config and whether it was calibrated",
        check.configure,
        check.run,
    )
)
register(
    Subcommand(
        "calibrate",
        "score labelled rows with every head and write a model config (without --data: "
        "the attention-only and combined configs from the packaged pool, with their report)",
        calibrate.configure,
        calibrate.run,
    )
)
register(
    Subcommand(
        "evaluate",
        "AUROC, AUPRC and TPR at fixed FPR of model configs on rows, "
        "with a keyword baseline; JSON, markdown and ROC plot",
        evaluate.configure,
        evaluate.run,
    )
)
register(
    Subcommand(
        "split",
        "hold out whole source contexts: write a split file (group ids)",
        rows.configure_split,
        rows.run_split,
    )
)
register(
    Subcommand(
        "crop",
        "short-data rows: each context's clean data cropped, its attacks put back in "
        "(calibrate on them too when your traffic has short data)",
        rows.configure_crop,
        rows.run_crop,
    )
)
register(
    Subcommand(
        "threshold",
        "re-set a model config's threshold on clean requests of your own traffic "
        "(keeps its heads and weights)",
        threshold.configure,
        threshold.run,
    )
)
register(Subcommand("steer", "build an activation-steering vector", steer.configure, steer.run))
