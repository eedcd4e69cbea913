"""What the ``guardrail`` subcommands share: model arguments, the engine, scoring with a cache."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from guardrail.engine.install import engine_arg
from guardrail.errors import ConfigError, GuardrailError, RequestError
from guardrail.offline.datasets import (
    LabelledPair,
    ScoreTable,
    content_key,
    load_pairs,
    make_injected_twins,
    read_split,
    sample_groups,
)
from guardrail.offline.layouts import request_for
from guardrail.offline.row_schema import rows_help
from guardrail.probe.config import HiddenPosition, ModelProbeConfig
from guardrail.probe.scoring import ATTENTION_STATS, HeadKey

# -- shared arguments and engine ------------------------------------------------------------


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


def add_data_argument(parser: argparse.ArgumentParser, help: str = "JSONL files of rows") -> None:
    """``--data`` (one or more JSONL files) and, as the parser's epilog, the rows' format."""
    parser.add_argument(
        "--data", nargs="+", required=True, type=Path, help=f"{help} (format: below)"
    )
    parser.epilog = rows_help()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments every command that scores rows shares: model, data, engine sizes, cache."""
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M)")
    add_data_argument(parser)
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
        "scored by the model)",
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


def open_engine(model: str, heads: Sequence[HeadKey] | str, args: argparse.Namespace) -> Any:
    """Start a ``HookedLLM`` that scores ``heads`` ("all" for calibration)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from guardrail.engine import HookedLLM

    first: list[HeadKey] = [(0, 0)] if isinstance(heads, str) else [tuple(heads[0])]  # type: ignore[list-item]
    # Only head_stats are used; the model path as id keeps the served-model check quiet.
    placeholder = ModelProbeConfig(model_id=str(model), heads=first)
    engine_kwargs: dict[str, Any] = {
        "enforce_eager": True,  # the hidden-state read-outs run in eager mode only
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **({} if args.dtype is None else {"dtype": args.dtype}),
        **dict(getattr(args, "engine_arg", None) or []),  # any vLLM argument; it wins
    }
    return HookedLLM(
        model,
        placeholder,
        probe_heads=heads,
        probe_hidden_layers=list(getattr(args, "hidden_layers", None) or []),
        probe_data_mean_layers=list(getattr(args, "data_mean_layers", None) or []),
        **engine_kwargs,
    )


def read_rows(
    args: argparse.Namespace, split: Path | None, held_out: bool, twins: int = 3
) -> tuple[list[LabelledPair], bool]:
    """Load ``--data``; keep one side of ``split``; subsample groups; add twins if unlabelled.

    ``held_out=True`` keeps the split file's held-out groups, False the others.
    """
    pairs, labelled = load_pairs(args.data)
    if split is not None:
        groups = read_split(split)
        pairs = [p for p in pairs if (p.group in groups) == held_out]
    if args.max_groups_per_task:
        pairs = sample_groups(pairs, args.max_groups_per_task, args.seed)
    if not labelled:
        pairs = pairs + make_injected_twins(pairs, twins, args.seed)
    if not pairs:
        raise ConfigError("no rows left after the split and subsampling")
    return pairs, labelled


# -- scoring ---------------------------------------------------------------------------------


def score_pairs(
    engine: Any,
    pairs: Sequence[LabelledPair],
    batch_size: int = 32,
    max_prompt_tokens: int | None = None,
    model: str = "",
    checkpoint: Callable[[ScoreTable, list[dict[str, str]]], None] | None = None,
) -> tuple[ScoreTable, list[dict[str, str]]]:
    """Per-head attention stats of each row through the engine's probe; also the rows it skipped.

    Rows longer than ``max_prompt_tokens`` or the engine's context, and rows the probe could
    not score, are skipped and listed with the reason. ``checkpoint`` is called after every
    batch with what was scored so far (the score cache saves it, so a stopped run resumes).
    """
    heads = list(engine.probe_heads)
    hidden_layers = list(getattr(engine, "probe_hidden_layers", []))
    mean_layers = list(getattr(engine, "probe_data_mean_layers", []))
    keys, values, prompt_tokens, data_tokens = [], [], [], []
    streams: dict[int, list[Any]] = {layer: [] for layer in hidden_layers}
    means: dict[int, list[Any]] = {layer: [] for layer in mean_layers}
    skipped: list[dict[str, str]] = []
    todo = []
    for pair in pairs:
        try:
            prepared = engine.prepare(request_for(pair))
        except RequestError as exc:
            skipped.append({"id": pair.id, "reason": str(exc)[:160]})
            continue
        if max_prompt_tokens and len(prepared.token_ids) > max_prompt_tokens:
            skipped.append(
                {
                    "id": pair.id,
                    "reason": f"{len(prepared.token_ids)} prompt tokens "
                    f"> --max-prompt-tokens {max_prompt_tokens}",
                }
            )
            continue
        todo.append(pair)
    bar = tqdm(total=len(todo), desc="scoring", unit="row", disable=len(todo) == 0)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        for pair, out in zip(chunk, engine.score([request_for(p) for p in chunk]), strict=True):
            probe = out.probe
            if out.error is not None or probe is None or not probe.head_stats:
                reason = str(out.error or (probe.error if probe else "no probe result"))
                skipped.append({"id": pair.id, "reason": reason[:160]})
                continue
            if any(layer not in probe.data_mean_states for layer in mean_layers):
                skipped.append({"id": pair.id, "reason": "no data tokens to average"})
                continue
            keys.append(content_key(pair))
            values.append([probe.head_stats[h] for h in heads])
            for layer in hidden_layers:
                streams[layer].append(probe.hidden_states[layer])
            for layer in mean_layers:
                means[layer].append(probe.data_mean_states[layer])
            prompt_tokens.append(probe.num_prompt_tokens)
            data_tokens.append(out.prompt.num_data_tokens)
        bar.update(len(chunk))
        if checkpoint is not None and start + batch_size < len(todo):
            checkpoint(
                _table(model, heads, keys, values, prompt_tokens, data_tokens, streams, means),
                skipped,
            )
    bar.close()
    table = _table(model, heads, keys, values, prompt_tokens, data_tokens, streams, means)
    return table, skipped


def _table(
    model: str,
    heads: list[HeadKey],
    keys: list[str],
    values: list[list[Any]],
    prompt_tokens: list[int],
    data_tokens: list[int],
    streams: dict[int, list[Any]],
    means: dict[int, list[Any]],
) -> ScoreTable:
    return ScoreTable(
        model,
        heads,
        list(keys),
        np.asarray(values, dtype=float).reshape(-1, len(heads), len(ATTENTION_STATS)),
        np.asarray(prompt_tokens),
        np.asarray(data_tokens),
        hidden={
            layer: np.asarray(rows, dtype=np.float32).reshape(len(keys), -1)
            for layer, rows in streams.items()
        },
        data_mean={
            layer: np.asarray(rows, dtype=np.float32).reshape(len(keys), -1)
            for layer, rows in means.items()
        },
    )


def scores_for(
    pairs: Sequence[LabelledPair],
    args: argparse.Namespace,
    model: str,
    heads: Sequence[HeadKey] | str,
    engine: Any,
) -> tuple[list[LabelledPair], ScoreTable, list[dict[str, str]], float]:
    """Scores of ``pairs`` from the cache and/or the engine; (rows kept, table, skipped, s).

    The returned table's rows line up with the returned pairs. With a cache, every head is
    scored (so the cache serves any later config) and new rows are added to the file.
    """
    started = time.perf_counter()
    cache = (
        ScoreTable.load(args.scores_cache)
        if args.scores_cache and args.scores_cache.exists()
        else None
    )
    if cache is not None and cache.model != model:
        raise GuardrailError(
            f"--scores-cache {args.scores_cache} holds scores of {cache.model!r}, "
            f"not {model!r}: use another cache file"
        )
    wanted_hidden = sorted(getattr(args, "hidden_layers", None) or [])
    if cache is not None:
        if not set(wanted_hidden) <= set(cache.hidden):
            raise GuardrailError(
                f"--scores-cache {args.scores_cache} holds hidden states of layers "
                f"{sorted(cache.hidden)}, not the {wanted_hidden} asked for: use another cache "
                "file"
            )
        wanted_means = sorted(getattr(args, "data_mean_layers", None) or [])
        if not set(wanted_means) <= set(cache.data_mean):
            raise GuardrailError(
                f"--scores-cache {args.scores_cache} holds data-mean states of layers "
                f"{sorted(cache.data_mean)}, not the {wanted_means} asked for: use another "
                "cache file"
            )
        args.hidden_layers = sorted(cache.hidden)  # new rows are read like the cached ones
        args.data_mean_layers = sorted(cache.data_mean)
    found = set(cache.rows(pairs)[0]) if cache is not None else set()
    known_skips = cache.skipped if cache is not None else {}
    skipped = [
        {"id": p.id, "reason": known_skips[content_key(p)]}
        for p in pairs
        if content_key(p) in known_skips
    ]
    missing = [
        p for i, p in enumerate(pairs) if i not in found and content_key(p) not in known_skips
    ]
    if missing:
        wanted = "all" if args.scores_cache else heads
        own = engine is None
        engine = engine or open_engine(model, wanted, args)
        by_id = {p.id: content_key(p) for p in missing}
        known = cache

        def with_known(fresh: ScoreTable, new_skips: list[dict[str, str]]) -> ScoreTable:
            fresh.skipped = {by_id[row["id"]]: row["reason"] for row in new_skips}
            return fresh if known is None else known.merged(fresh)

        def save_progress(fresh: ScoreTable, new_skips: list[dict[str, str]]) -> None:
            with_known(fresh, new_skips).save(args.scores_cache)

        try:
            fresh, new_skips = score_pairs(
                engine,
                missing,
                args.batch_size,
                args.max_prompt_tokens,
                model,
                checkpoint=save_progress if args.scores_cache else None,
            )
        finally:
            if own:
                engine.close()
        skipped += new_skips
        cache = with_known(fresh, new_skips)
        if args.scores_cache:
            cache.save(args.scores_cache)
    assert cache is not None
    index, rows = cache.rows(pairs)
    return [pairs[i] for i in index], cache.select(rows), skipped, time.perf_counter() - started


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def config_focus(config: ModelProbeConfig, table: ScoreTable) -> np.ndarray:
    """The focus score ``config`` gives each row of ``table`` (which must hold its heads, and
    the hidden streams of its hidden layers when it reads any)."""
    column = {h: j for j, h in enumerate(table.heads)}
    missing = [h for h in config.heads if h not in column]
    if missing:
        raise ConfigError(
            f"scores lack heads {missing[:5]} of config {config.model_id!r}; "
            "score with every head (use a fresh --scores-cache)"
        )
    reads: list[tuple[HiddenPosition, dict[int, np.ndarray], str]] = [
        ("last", table.hidden, "--hidden-layers"),
        ("data_mean", table.data_mean, "--data-mean-layers"),
    ]
    for position, held, flag in reads:
        needed = config.hidden_layers_at(position)
        lacking = [layer for layer in needed if layer not in held]
        if lacking:
            raise ConfigError(
                f"config {config.model_id!r} reads the hidden state of layers {lacking} at "
                f"position {position!r}, which the scores lack (they hold layers "
                f"{sorted(held)}): score with {flag} {' '.join(map(str, needed))} (and a fresh "
                "--scores-cache)"
            )
    cols = [column[h] for h in config.heads]
    terms: list[dict[int, float]] = []
    for i in range(len(table.keys)):
        row: dict[int, float] = {}
        for part in config.hidden or []:
            streams = table.hidden if part.position == "last" else table.data_mean
            row[part.layer] = row.get(part.layer, 0.0) + part.project(streams[part.layer][i])
        terms.append(row)
    return np.array(
        [
            config.focus(dict(zip(config.heads, row[cols], strict=True)), terms[i])
            for i, row in enumerate(table.values)
        ]
    )


def hidden_layers_for(args: argparse.Namespace, configs: Sequence[ModelProbeConfig]) -> None:
    """Read the hidden layers the configs need, unless ``--hidden-layers`` /
    ``--data-mean-layers`` name them."""
    names: list[tuple[HiddenPosition, str]] = [
        ("last", "hidden_layers"),
        ("data_mean", "data_mean_layers"),
    ]
    for position, name in names:
        needed = sorted({layer for c in configs for layer in c.hidden_layers_at(position)})
        if needed and not getattr(args, name, None):
            setattr(args, name, needed)


def count(values: Any) -> dict[str, int]:
    """How often each value occurs, sorted by value."""
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))
