"""The old home of what the ``guardrail`` subcommands share; kept so imports keep working.

The names live in :mod:`guardrail.cli.options` (shared arguments), :mod:`guardrail.cli.output`
(JSON files, counts), :mod:`guardrail.offline.row_scores` (scoring rows, the score cache,
a config's focus) and :mod:`guardrail.offline.datasets` (``read_rows``). The library functions
take typed arguments (``ScoringSettings``, keywords), not an ``argparse.Namespace``;
``hidden_layers_for`` (which changed the parsed arguments) is gone: ``layers_read_by`` says
which layers configs read.
"""

from __future__ import annotations

from guardrail.cli.options import (
    add_data_argument,
    add_engine_arg,
    add_model_arguments,
    resolve_model,
)
from guardrail.cli.output import count, write_json
from guardrail.offline.datasets import read_rows
from guardrail.offline.row_scores import (
    ScoringSettings,
    config_focus,
    layers_read_by,
    open_engine,
    score_pairs,
    scores_for,
)

__all__ = [
    "ScoringSettings",
    "add_data_argument",
    "add_engine_arg",
    "add_model_arguments",
    "config_focus",
    "count",
    "layers_read_by",
    "open_engine",
    "read_rows",
    "resolve_model",
    "score_pairs",
    "scores_for",
    "write_json",
]
