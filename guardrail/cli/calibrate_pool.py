"""``guardrail calibrate`` without ``--data``: both configs of the pool recipe and their report.

The packaged pool's rows (:mod:`guardrail.offline.pool`) are scored once through the serving
probe (every head; the last-token and data-mean streams of the recipe's candidate layers) and
:func:`guardrail.offline.pool_fit.calibrate_on_pool` fits the attention-only and the combined
probe, the combined one with a token read-out whose models a second pass over the data tokens
scores (``--token-samples``; its models and their second pass kept beside the score cache as
``<cache>.token-models.npz`` and ``<cache>.token-logits.npz``);
:func:`guardrail.offline.pool_report.write_pool_calibration` writes ``<name>.json``,
``<name>.combined.json`` and ``<name>.report.{json,md,png}``. For the embedded SmolLM2 this is
the writer of the shipped configs: ``guardrail calibrate --out model_configs --report
benchmarks/results/calibrate_pool_smollm2/SmolLM2-135M-Instruct.report.json`` rebuilds them
(the report elsewhere: every JSON file in model_configs/ is read as a config).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from guardrail.cli.options import pool_rows_of, resolve_model, scoring_settings
from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair
from guardrail.offline.pool import added_rows, pool_summary
from guardrail.offline.pool_fit import ModelShape, calibrate_on_pool
from guardrail.offline.pool_report import write_pool_calibration
from guardrail.offline.row_scores import ScoringSettings, scores_for
from guardrail.offline.served import top_token_logits
from guardrail.offline.token_readout import TokenModel
from guardrail.offline.transfer import ScoredPool, TransferRecipe, recipe_for

__all__ = ["POOL", "POOL_MAX_PROMPT_TOKENS", "run_pool"]

POOL = "the labelled calibration pool installed with the package (guardrail/pool)"
POOL_MAX_PROMPT_TOKENS = 2048
"""Without ``--max-prompt-tokens``, pool rows longer than this are skipped (as for the shipped
SmolLM2 configs: 8 of the 3,020 rows)."""


def _pool_rows(args: argparse.Namespace) -> tuple[list[LabelledPair], str]:
    """The pool's rows (``--pool-sources``, ``--exclude-split``, ``--max-groups-per-task``)
    and their description, after printing each source with its licence."""
    pairs = pool_rows_of(args, args.exclude_split, args.pool_sources)
    print(f"no --data: calibrating on {POOL}")
    for line in pool_summary(pairs):
        print(f"  {line}")
    corpora = sorted({str(p.extra["corpus"]) for p in pairs})
    added: list[LabelledPair] = []
    for path in args.add_data or []:
        mine = added_rows([path])
        added += mine
        clean = sum(p.label == 0 for p in mine)
        names = sorted({str(p.extra["corpus"]) for p in mine})
        print(
            f"  added from {path}: {len(mine)} rows ({clean} clean / {len(mine) - clean} "
            f"injected) as source {', '.join(names)}"
        )
    text = (
        f"the calibration pool installed with vllm-guardrail (guardrail/pool/manifest.json: "
        f"{', '.join(corpora)}; licences there), each row in the pair layout and one drawn other "
        "layout"
    )
    if args.exclude_split:
        text += f", minus the held-out groups of {args.exclude_split.name}"
    if args.max_groups_per_task:
        text += f", at most {args.max_groups_per_task} source contexts per task (seed {args.seed})"
    if added:
        taken = {p.id for p in pairs}
        clash = next((p.id for p in added if p.id in taken), None)
        if clash is not None:
            source, row = clash.split(":", 1)
            raise ConfigError(
                f"--add-data row {row.rsplit('~', 1)[0]!r} of source {source} has the id of a "
                "pool row: give it another 'id'"
            )
        files = ", ".join(Path(p).name for p in args.add_data)
        text += f", plus {len(added)} rows added from {files} (--add-data)"
    return pairs + added, text


def _pool_recipe(args: argparse.Namespace, shape: ModelShape) -> TransferRecipe:
    """The model's pool recipe, with the stream layers and threshold rate the flags give."""
    recipe = recipe_for(shape.model_id, shape.num_layers)
    if args.hidden_layers:
        recipe = replace(recipe, hidden_candidates=tuple(args.hidden_layers))
    if args.data_mean_layers:
        recipe = replace(recipe, data_mean_layers=tuple(args.data_mean_layers))
    if args.token_layers < 1:
        raise ConfigError(f"--token-layers must be at least 1, got {args.token_layers}")
    return replace(recipe, target_fpr=args.target_fpr, token_layers=args.token_layers)


def _pool_settings(args: argparse.Namespace, recipe: TransferRecipe) -> ScoringSettings:
    """Every head, and the streams of every layer the recipe may read, of rows up to
    ``--max-prompt-tokens`` (default ``POOL_MAX_PROMPT_TOKENS``)."""
    return replace(
        scoring_settings(args),
        max_prompt_tokens=args.max_prompt_tokens or POOL_MAX_PROMPT_TOKENS,
        hidden_layers=recipe.hidden_candidates,
        data_mean_layers=recipe.data_mean_layers or recipe.hidden_candidates,
        token_samples=max(args.token_samples, 0),
    )


def _check_report_place(report: Path) -> None:
    """Refuse a report inside the package's model_configs/ (its JSON files are all configs)."""
    from importlib.resources import files

    shipped = Path(str(files("guardrail.model_configs"))).resolve()
    if report.parent.resolve() == shipped:
        raise ConfigError(
            f"the report {report} would land in {shipped}, where every JSON file is read as a "
            "model config: pass --report elsewhere (the shipped SmolLM2 configs' report: "
            "benchmarks/results/calibrate_pool_smollm2/SmolLM2-135M-Instruct.report.json)"
        )


def _token_device() -> str | None:
    """Where the token models are fitted: the GPU when there is one, else scikit-learn on the
    host (what made the shipped configs)."""
    import torch

    return "cuda" if torch.cuda.is_available() else None


def run_pool(args: argparse.Namespace, engine: Any) -> int:
    """Without ``--data``: both configs of the pool recipe and their report (module doc)."""
    model, default_id = resolve_model(args.model)
    shape = ModelShape.of(model, args.model_id or default_id)
    stem = args.name or shape.model_id.split("/")[-1]
    _check_report_place(args.report or args.out / f"{stem}.report.json")
    recipe = _pool_recipe(args, shape)
    pairs, source = _pool_rows(args)
    settings = _pool_settings(args, recipe)
    pairs, table, skipped, score_seconds = scores_for(pairs, model, "all", settings, engine)
    tqdm.write(f"scores of {len(pairs)} rows ready after {score_seconds:.0f} s", file=sys.stderr)
    lacking = sorted(set(settings.hidden_layers) - set(table.hidden))
    lacking += sorted(set(settings.data_mean_layers) - set(table.data_mean))
    if lacking:
        raise ConfigError(
            f"the pool recipe reads the streams of layers {list(settings.hidden_layers)} (last "
            f"token) and {list(settings.data_mean_layers)} (data mean); the scores lack "
            f"{lacking}: pass an engine that reads them, or a fresh --scores-cache"
        )
    dataset = f"{source}, rows over {settings.max_prompt_tokens} prompt tokens skipped "
    dataset += f"({len(skipped)})"
    started = time.perf_counter()
    pool = ScoredPool(pairs, table)
    sources = len(set(pool.corpus.tolist()))
    steps = 2 + len(recipe.hidden_candidates) + sources
    if settings.token_samples:  # the models of each scope, the pass, each C tried
        steps += sources + 2 + 3
    cache = args.scores_cache
    logits_cache = None if cache is None else cache.with_suffix(".token-logits.npz")
    models_cache = None if cache is None else cache.with_suffix(".token-models.npz")

    def top_logits_of(models: list[TokenModel]) -> Any:
        return top_token_logits(pool.rows, models, model, settings, engine, logits_cache)

    with tqdm(total=steps, desc="fits", unit="fit") as bar:

        def progress(step: str) -> None:
            bar.set_postfix_str(step)
            bar.update(1)

        result = calibrate_on_pool(
            pool,
            shape,
            dataset,
            recipe,
            progress,
            top_logits_of if settings.token_samples else None,
            _token_device(),
            models_cache,
        )
    fit_seconds = time.perf_counter() - started
    report = args.report or args.out / f"{stem}.report.json"
    written = write_pool_calibration(result, args.out, stem, report, skipped)
    for kind, config in result.configs.items():
        hidden = [(p.layer, p.position, len(p.dims)) for p in config.hidden or []]
        print(
            f"{kind}: {len(config.heads)} heads on layers {config.layers}, hidden read-outs "
            f"{hidden or 'none'}, threshold {config.threshold}"
        )
    print(
        f"{len(pairs)} rows ({len(skipped)} skipped), scoring {score_seconds:.0f} s, fitting "
        f"{fit_seconds:.0f} s; wrote {', '.join(map(str, written))}"
    )
    return 0
