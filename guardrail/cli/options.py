"""The options the ``guardrail`` subcommands share (model, rows, score cache, engine) and
what they become: the library's typed arguments (:class:`ScoringSettings`, :func:`read_rows`).

The subcommands parse, then call the library with what these functions build from the parsed
arguments; nothing here changes the parsed arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from guardrail.engine.install import engine_arg
from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair, read_rows, read_split, sample_groups
from guardrail.offline.pool import load_pool
from guardrail.offline.row_schema import rows_help
from guardrail.offline.row_scores import ScoringSettings, layers_read_by
from guardrail.probe.config import ModelProbeConfig

__all__ = [
    "add_data_argument",
    "add_engine_arg",
    "add_model_arguments",
    "pool_rows_of",
    "resolve_model",
    "rows_of",
    "scoring_settings",
]

# -- the shared arguments ---------------------------------------------------------------------


def add_engine_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine-arg",
        type=engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM engine argument as HookedLLM takes it (repeat): tensor_parallel_size=2, "
        "gpu_memory_utilization=0.8, attention_backend=FLASH_ATTN, dtype=bfloat16, ... "
        "(default: none; on CPU the library fills in float32, eager mode and a KV cache size)",
    )


def add_data_argument(
    parser: argparse.ArgumentParser, help: str = "JSONL files of rows", required: bool = True
) -> None:
    """``--data`` (one or more JSONL files) and, as the parser's epilog, the rows' format."""
    parser.add_argument(
        "--data", nargs="+", required=required, type=Path, help=f"{help} (format: below)"
    )
    parser.epilog = rows_help()


def add_model_arguments(parser: argparse.ArgumentParser, data_default: str | None = None) -> None:
    """Arguments every command that scores rows shares: model, data, engine sizes, cache.
    ``--data`` is required, unless ``data_default`` says what a command uses without it."""
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M)")
    if data_default is None:
        add_data_argument(parser)
    else:
        add_data_argument(parser, f"JSONL files of rows (default: {data_default})", False)
    parser.add_argument(
        "--max-groups-per-task",
        type=int,
        default=None,
        help="subsample: keep at most this many source contexts per task (default: all)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip rows whose prompt is longer, and report them (default: only rows that do "
        "not fit --max-model-len are skipped)",
    )
    parser.add_argument(
        "--scores-cache",
        type=Path,
        default=None,
        help=".npz file of per-head scores to reuse and extend (default: none, every row is "
        "scored by the model); calibration on the pool also keeps its token models and their "
        "second pass beside it (<cache>.token-models.npz, <cache>.token-logits.npz), so a run "
        "cut short resumes where it stopped",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="rows per engine call")
    parser.add_argument(
        "--max-model-len", type=int, default=4096, help="vLLM's max_model_len: the longest prompt"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="vLLM's max_num_batched_tokens: tokens per engine step",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="vLLM's dtype (default: float32 on CPU, where the shipped configs were "
        "calibrated; the model's own dtype on a GPU)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the subsampling, generated twins and engine"
    )
    parser.add_argument(
        "--hidden-layers",
        type=int,
        nargs="*",
        default=[],
        help="decoder layers whose residual stream at the last prompt token is read too "
        "(calibrate: the combined probe reads attention and these layers) (default: none)",
    )
    parser.add_argument(
        "--data-mean-layers",
        type=int,
        nargs="*",
        default=[],
        help="decoder layers whose residual stream averaged over the data tokens is read too "
        "(calibrate: the combined probe reads these as well) (default: none)",
    )
    add_engine_arg(parser)


def resolve_model(model: str | None) -> tuple[str, str]:
    """(model path, model id): the embedded model when ``model`` is None."""
    if model is None:
        from guardrail.embedded import EMBEDDED_MODEL_ID, embedded_model_path

        return str(embedded_model_path()), EMBEDDED_MODEL_ID
    return model, Path(model).name


# -- what they become -----------------------------------------------------------------------


def scoring_settings(
    args: argparse.Namespace, configs: Sequence[ModelProbeConfig] = ()
) -> ScoringSettings:
    """How the rows of ``args`` are scored. The hidden layers are ``--hidden-layers`` and
    ``--data-mean-layers``, or when a flag is not given, the layers ``configs`` read."""
    return ScoringSettings(
        scores_cache=args.scores_cache,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        hidden_layers=tuple(args.hidden_layers or layers_read_by(configs, "last")),
        data_mean_layers=tuple(args.data_mean_layers or layers_read_by(configs, "data_mean")),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        seed=args.seed,
        engine_args=dict(args.engine_arg),
    )


def rows_of(
    args: argparse.Namespace, split: Path | None, held_out: bool, twins: int = 3
) -> tuple[list[LabelledPair], bool]:
    """:func:`read_rows` of ``--data``, subsampled by ``--max-groups-per-task`` and ``--seed``."""
    return read_rows(
        args.data,
        split,
        held_out=held_out,
        max_groups_per_task=args.max_groups_per_task,
        seed=args.seed,
        twins=twins,
    )


def pool_rows_of(
    args: argparse.Namespace, split: Path | None, sources: Sequence[str] | None = None
) -> list[LabelledPair]:
    """The packaged pool's rows (:func:`load_pool` of ``sources``, default all) minus the
    groups ``split`` holds out (as tagged, ``bipia:email:3``, or as in the source file,
    ``email:3``), subsampled by ``--max-groups-per-task`` and ``--seed``."""
    pairs = load_pool(sources)
    if split is not None:
        held = read_split(split)
        pairs = [
            p for p in pairs if not {p.group, p.group.removeprefix(f"{p.extra['corpus']}:")} & held
        ]
    if args.max_groups_per_task:
        pairs = sample_groups(pairs, args.max_groups_per_task, args.seed)
    if not pairs:
        raise ConfigError("no rows of the calibration pool left after the split and subsampling")
    return pairs
