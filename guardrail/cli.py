"""The ``guardrail`` command: ``calibrate`` a model config, ``evaluate`` detection quality.

Subcommands live in a registry (:data:`SUBCOMMANDS`), each a name, a help line, a function
adding its arguments and a function running it; add one with :func:`register`.

    guardrail calibrate --data pairs.jsonl --out model_configs/        # embedded SmolLM2
    guardrail evaluate --config model_configs/X.json --data pairs.jsonl --out-dir results/
    guardrail threshold --config model_configs/X.json --data my_clean.jsonl --out mine.json

Head scores come from the serving probe itself (every head of every layer in calibration
mode), so calibration and serving measure the same thing. ``--scores-cache`` keeps them in an
``.npz`` file so a second run (or ``evaluate`` after ``calibrate``) does not re-run the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from guardrail.calibration import CalibrationSettings, calibrate_probes, retarget_threshold
from guardrail.config import Calibration, ModelProbeConfig, read_model_config
from guardrail.datasets import (
    LabelledPair,
    ScoreTable,
    content_key,
    load_pairs,
    make_injected_twins,
    pairs_sha256,
    read_split,
    sample_groups,
    short_crops,
    split_by_group,
    write_pairs,
    write_split,
)
from guardrail.errors import ConfigError, GuardrailError, RequestError
from guardrail.evaluation import (
    detection_metrics,
    evaluate_detectors,
    keyword_score,
    markdown_report,
    plot_layer_sweep,
    plot_roc,
)
from guardrail.scoring import ATTENTION_STATS, HeadKey
from guardrail.steering_build import configure_steer, run_steer

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main", "register", "score_pairs"]


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per registered subcommand."""
    parser = argparse.ArgumentParser(prog="guardrail", description=__doc__.split("\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS.values():
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, engine: Any = None) -> int:
    """Entry point of the console script; ``engine`` reuses a started ``HookedLLM`` (tests).

    Example:
        >>> main(["calibrate", "--data", "pairs.jsonl", "--out", "configs/"])  # doctest: +SKIP
        0
    """
    args = build_parser().parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args, engine)
    except GuardrailError as exc:
        print(f"guardrail {args.command}: error: {exc}", file=sys.stderr)
        return 2


# -- shared arguments and engine ------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments every command that scores rows shares: model, data, engine sizes, cache."""
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--data",
        nargs="+",
        required=True,
        type=Path,
        help="JSONL files of {instruction, data, label, ...} rows",
    )
    parser.add_argument(
        "--max-groups-per-task",
        type=int,
        default=None,
        help="subsample: keep at most this many source contexts per task",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip rows whose prompt is longer (reported in the output)",
    )
    parser.add_argument(
        "--scores-cache",
        type=Path,
        default=None,
        help=".npz file of per-head scores to reuse and extend",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="rows per engine call")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)


def resolve_model(model: str | None) -> tuple[str, str]:
    """(model path, model id): the embedded model when ``model`` is None."""
    if model is None:
        from guardrail.embedded import EMBEDDED_MODEL_ID, embedded_model_path

        return str(embedded_model_path()), EMBEDDED_MODEL_ID
    return model, Path(model).name


def open_engine(model: str, heads: Sequence[HeadKey] | str, args: argparse.Namespace) -> Any:
    """Start a ``HookedLLM`` that scores ``heads`` ("all" for calibration)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from guardrail.engine import HookedLLM

    first: list[HeadKey] = [(0, 0)] if isinstance(heads, str) else [tuple(heads[0])]  # type: ignore[list-item]
    placeholder = ModelProbeConfig(model_id="calibration", heads=first)  # only head_stats used
    return HookedLLM(
        model,
        placeholder,
        probe_heads=heads,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=args.seed,
        max_num_batched_tokens=args.max_num_batched_tokens,
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
    keys, values, prompt_tokens, data_tokens = [], [], [], []
    skipped: list[dict[str, str]] = []
    todo = []
    for pair in pairs:
        try:
            prepared = engine.prepare((pair.instruction, pair.data))
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
        for pair, out in zip(
            chunk, engine.score([(p.instruction, p.data) for p in chunk]), strict=True
        ):
            probe = out.probe
            if out.error is not None or probe is None or not probe.head_stats:
                reason = str(out.error or (probe.error if probe else "no probe result"))
                skipped.append({"id": pair.id, "reason": reason[:160]})
                continue
            keys.append(content_key(pair))
            values.append([probe.head_stats[h] for h in heads])
            prompt_tokens.append(probe.num_prompt_tokens)
            data_tokens.append(sum(b - a for a, b in out.prompt.data_spans))
        bar.update(len(chunk))
        if checkpoint is not None and start + batch_size < len(todo):
            checkpoint(_table(model, heads, keys, values, prompt_tokens, data_tokens), skipped)
    bar.close()
    return _table(model, heads, keys, values, prompt_tokens, data_tokens), skipped


def _table(
    model: str,
    heads: list[HeadKey],
    keys: list[str],
    values: list[list[Any]],
    prompt_tokens: list[int],
    data_tokens: list[int],
) -> ScoreTable:
    return ScoreTable(
        model,
        heads,
        list(keys),
        np.asarray(values, dtype=float).reshape(-1, len(heads), len(ATTENTION_STATS)),
        np.asarray(prompt_tokens),
        np.asarray(data_tokens),
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


# -- calibrate -------------------------------------------------------------------------------


def _configure_calibrate(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the config to")
    parser.add_argument("--model-id", help="model id in the config (default: the model's name)")
    parser.add_argument("--name", help="config file stem (default: last part of the model id)")
    parser.add_argument(
        "--exclude-split",
        type=Path,
        help="split file (guardrail split): leave its held-out groups out",
    )
    parser.add_argument(
        "--twins-per-row",
        type=int,
        default=3,
        help="injected twins per benign row, when the data has no labels",
    )
    parser.add_argument("--probe", choices=["auto", "logistic", "mean_focus"], default="auto")
    parser.add_argument(
        "--feature",
        choices=["logit_focus", "attention_stats", "focus"],
        default="logit_focus",
        help="what the logistic probe weighs per head (default: logit of its focus; "
        "attention_stats: five stats per head, higher AUROC on rows like the calibration rows "
        "but it transferred worse to other prompt formats, see docs/detection.md)",
    )
    parser.add_argument("--threshold-rule", choices=["fpr", "midpoint"], default="fpr")
    parser.add_argument("--target-fpr", type=float, default=0.01)
    parser.add_argument("--max-layers", type=int, default=6, help="largest layer budget swept")
    parser.add_argument(
        "--layers",
        type=_layer_budget,
        default="auto",
        help="hooked-layer budget of the written config: auto (the fewest layers within 0.005 "
        "CV AUROC of the best, default), all (L1 over every layer), or a number of layers "
        "(the sweep's step with that many; the report lists them all)",
    )
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds (by group)")
    parser.add_argument("--report", type=Path, help="write the full calibration report (JSON)")


def _layer_budget(text: str) -> int | str:
    if text in ("auto", "all"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto, all or a number of layers >= 1, got {text!r}")


def probe_config(
    probe: dict[str, Any],
    kind: str,
    model_id: str,
    heads: Sequence[HeadKey],
    provenance: dict[str, Any],
) -> ModelProbeConfig:
    """A validated ``ModelProbeConfig`` from one probe of :func:`calibrate_probes`."""
    return ModelProbeConfig(
        model_id=model_id,
        probe=kind,  # type: ignore[arg-type]
        heads=[(int(a), int(b)) for a, b in probe["heads"]],
        weights=probe["weights"] if kind == "logistic" else None,
        bias=probe["bias"] if kind == "logistic" else 0.0,
        feature=probe.get("feature", "focus") if kind == "logistic" else "focus",
        threshold=probe["threshold"],
        num_layers=max(h[0] for h in heads) + 1,
        num_heads=max(h[1] for h in heads) + 1,
        source="guardrail calibrate: per-head attention stats from the serving probe",
        calibration=Calibration(
            **provenance, thresholds=probe["thresholds"], notes=probe.get("notes", "")
        ),
    )


def _provenance(
    args: argparse.Namespace, pairs: Sequence[LabelledPair], labelled: bool, skipped: list[Any]
) -> dict[str, Any]:
    """What the config records about its calibration rows: a description, count and hash."""
    source = ", ".join(p.name for p in args.data) + ("" if labelled else " + generated twins")
    if args.exclude_split:
        source += f", minus the held-out groups of {args.exclude_split.name}"
    if args.max_groups_per_task:
        source += (
            f", at most {args.max_groups_per_task} source contexts per task (seed {args.seed})"
        )
    if args.max_prompt_tokens:
        source += f", rows over {args.max_prompt_tokens} prompt tokens skipped ({len(skipped)})"
    return {"dataset": source, "num_examples": len(pairs), "sha256": pairs_sha256(pairs)}


def _fit(
    args: argparse.Namespace, pairs: Sequence[LabelledPair], table: ScoreTable
) -> dict[str, Any]:
    labels = np.array([p.label for p in pairs])
    if len(np.unique(labels)) < 2:
        raise ConfigError(
            f"calibration needs clean and injected rows; got {len(pairs)} scored "
            f"rows with labels {sorted(set(labels.tolist()))}"
        )
    settings = CalibrationSettings(
        target_fpr=args.target_fpr,
        threshold_rule=args.threshold_rule,
        max_layers=max(args.max_layers, args.layers if isinstance(args.layers, int) else 0),
        budget=args.layers,
        probe=args.probe,
        feature=args.feature,
        folds=args.folds,
        seed=args.seed,
    )
    with tqdm(total=settings.max_layers, desc="layer sweep", unit="layer") as bar:
        return calibrate_probes(
            table.values,
            labels,
            table.heads,
            [p.group for p in pairs],
            settings,
            progress=lambda done, total: bar.update(1),
        )


def _run_calibrate(args: argparse.Namespace, engine: Any) -> int:
    model, default_id = resolve_model(args.model)
    model_id = args.model_id or default_id
    pairs, labelled = read_rows(args, args.exclude_split, False, args.twins_per_row)
    pairs, table, skipped, score_seconds = scores_for(pairs, args, model, "all", engine)
    started = time.perf_counter()
    result = _fit(args, pairs, table)
    fit_seconds = time.perf_counter() - started
    provenance = _provenance(args, pairs, labelled, skipped)
    configs = {
        kind: probe_config(probe, kind, model_id, table.heads, provenance)
        for kind, probe in result["probes"].items()
    }
    path = args.out / f"{args.name or model_id.split('/')[-1]}.json"
    write_json(path, configs[result["chosen"]].model_dump(mode="json"))
    read_model_config(path)  # what was written loads and validates
    if args.report:
        sweep = [
            {
                "num_layers": len(e["layers"]),
                "num_heads": len(e["probe"]["heads"]),
                **{k: v for k, v in e.items() if k != "probe"},
                "config": probe_config(
                    e["probe"], "logistic", model_id, table.heads, provenance
                ).model_dump(mode="json"),
            }
            for e in result["layer_sweep"]
        ]
        write_json(
            args.report,
            {
                "model": model_id,
                "rows": len(pairs),
                "tasks": _count(p.task for p in pairs),
                "skipped": {"count": len(skipped), "rows": skipped[:50]},
                "scoring_seconds": round(score_seconds, 1),
                "fit_seconds": round(fit_seconds, 1),
                **{k: result[k] for k in ("chosen", "selection_n", "n_search")},
                "layer_sweep": sweep,
                "cv_auroc": {k: p["cv_auroc"] for k, p in result["probes"].items()},
                "configs": {k: c.model_dump(mode="json") for k, c in configs.items()},
            },
        )
    chosen = configs[result["chosen"]]
    print(
        f"wrote {path}: probe {chosen.probe}, {len(chosen.heads)} heads on layers "
        f"{chosen.layers}, threshold {chosen.threshold:.4f}; {len(pairs)} rows "
        f"({len(skipped)} skipped), scoring {score_seconds:.0f} s, fitting {fit_seconds:.0f} s"
    )
    return 0


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


# -- evaluate --------------------------------------------------------------------------------


def _configure_evaluate(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--config",
        nargs="+",
        required=True,
        type=Path,
        help="model config JSON files, or calibration reports (calibrate "
        "--report) to compare both probe kinds and the layer sweep",
    )
    parser.add_argument("--split", type=Path, help="split file: evaluate its held-out groups only")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--name", default="detection", help="stem of the JSON and markdown files")
    parser.add_argument("--plot-dir", type=Path, help="where the PNGs go (default: --out-dir)")
    parser.add_argument(
        "--plot-stem", help="PNGs are roc_STEM.png, layers_STEM.png (default: --name)"
    )
    parser.add_argument("--title", default="Prompt-injection detection")


def load_detectors(
    paths: Sequence[Path],
) -> tuple[dict[str, ModelProbeConfig], list[dict[str, Any]]]:
    """Named probe configs (and layer-sweep entries) from config files or calibration reports."""
    configs: dict[str, ModelProbeConfig] = {}
    sweep: list[dict[str, Any]] = []

    def add(name: str, config: ModelProbeConfig, path: Path) -> None:
        # two files may give the same label (same stem, same layer count): name them by path
        if name in configs:
            name = f"{name} [{path}]"
        if name in configs:
            raise ConfigError(f"{path} is given twice to --config; pass each file once")
        configs[name] = config

    for path in paths:
        doc = json.loads(path.read_text())
        if "configs" not in doc:
            config = read_model_config(path)
            add(f"{config.probe} ({path.stem})", config, path)
            continue
        for kind, raw in doc["configs"].items():
            layers = len({h[0] for h in raw["heads"]})
            add(f"{kind} ({layers} layers)", ModelProbeConfig.model_validate(raw), path)
        sweep += [
            {**e, "config": ModelProbeConfig.model_validate(e["config"])}
            for e in doc.get("layer_sweep", [])
        ]
    return configs, sweep


def _focus(config: ModelProbeConfig, table: ScoreTable) -> np.ndarray:
    column = {h: j for j, h in enumerate(table.heads)}
    missing = [h for h in config.heads if h not in column]
    if missing:
        raise ConfigError(
            f"scores lack heads {missing[:5]} of config {config.model_id!r}; "
            "score with every head (use a fresh --scores-cache)"
        )
    cols = [column[h] for h in config.heads]
    return np.array(
        [config.focus(dict(zip(config.heads, row[cols], strict=True))) for row in table.values]
    )


def _measure(
    pairs: Sequence[LabelledPair],
    table: ScoreTable,
    configs: dict[str, ModelProbeConfig],
    sweep: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(detector name -> risk scores, report fields) for the probes and the baselines."""
    labels = [p.label for p in pairs]
    focus = {name: _focus(config, table) for name, config in configs.items()}
    detectors: dict[str, Any] = {name: 1.0 - f for name, f in focus.items()}
    detectors["keyword baseline"] = [keyword_score(p.data) for p in pairs]
    detectors["data length (tokens)"] = table.data_tokens.astype(float)
    attributes = {
        "position": [p.position for p in pairs],
        "attack_category": [p.attack_category for p in pairs],
    }
    fields = {
        "detectors": evaluate_detectors(
            labels,
            [p.task for p in pairs],
            attributes,
            detectors,
            bootstrap=True,
            groups=[p.group for p in pairs],
        ),
        "operating_points": {
            name: _operating_point(focus[name], labels, c.threshold)
            for name, c in configs.items()
            if c.threshold is not None
        },
        "layer_sweep": [
            {
                "num_layers": e["num_layers"],
                "layers": e["layers"],
                "num_heads": e["num_heads"],
                "cv_auroc": e.get("cv_auroc"),
                **detection_metrics(labels, 1.0 - _focus(e["config"], table)),
            }
            for e in sweep
        ],
    }
    return detectors, fields


def _run_evaluate(args: argparse.Namespace, engine: Any) -> int:
    model, _ = resolve_model(args.model)
    configs, sweep = load_detectors(args.config)
    pairs, _ = read_rows(args, args.split, held_out=True)
    needed = sorted(
        {h for c in [*configs.values(), *(e["config"] for e in sweep)] for h in c.heads}
    )
    pairs, table, skipped, seconds = scores_for(pairs, args, model, needed, engine)
    labels = [p.label for p in pairs]
    detectors, fields = _measure(pairs, table, configs, sweep)
    out, plots = args.out_dir, args.plot_dir or args.out_dir
    roc_png = plots / f"roc_{args.plot_stem or args.name}.png"
    layers_png = plots / f"layers_{args.plot_stem or args.name}.png"
    report = {
        "title": args.title,
        "model": model,
        "data": [str(p) for p in args.data],
        "split": str(args.split) if args.split else None,
        "rows": len(pairs),
        "skipped": {"count": len(skipped), "rows": skipped[:50]},
        "scoring_seconds": round(seconds, 1),
        **fields,
        "plots": [str(roc_png), *([str(layers_png)] if sweep else [])],
        "summary": [
            f"Model `{model}`; {len(pairs)} rows ({sum(labels)} injected), "
            f"{len(skipped)} skipped; data {', '.join(p.name for p in args.data)}"
            + (f", held-out groups of `{args.split.name}`." if args.split else ".")
        ],
    }
    write_json(out / f"{args.name}.json", report)
    (out / f"{args.name}.md").write_text(markdown_report(report, primary=next(iter(configs))))
    plot_roc({n: (labels, s) for n, s in detectors.items()}, roc_png, args.title)
    if sweep:
        plot_layer_sweep(fields["layer_sweep"], layers_png, "Logistic probe vs hooked layers")
    first = fields["detectors"][next(iter(configs))]["overall"]
    print(
        f"wrote {out / args.name}.{{json,md}} and plots: {next(iter(configs))} AUROC "
        f"{first['auroc']}, TPR@1%FPR {first['tpr@1%fpr']} on {len(pairs)} rows"
    )
    return 0


def _operating_point(
    focus: np.ndarray, labels: Sequence[int], threshold: float
) -> dict[str, float]:
    y = np.asarray(labels)
    flagged = focus <= threshold
    return {
        "threshold": threshold,
        "fpr": round(float(flagged[y == 0].mean()), 4),
        "tpr": round(float(flagged[y == 1].mean()), 4),
    }


# -- split ----------------------------------------------------------------------------------


def _configure_split(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", nargs="+", required=True, type=Path)
    parser.add_argument("--held-out", type=float, default=0.4, help="fraction of groups per task")
    parser.add_argument(
        "--max-held-out-groups", type=int, default=None, help="cap on held-out groups per task"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="split file to write (JSON)")


def _run_split(args: argparse.Namespace, engine: Any) -> int:
    pairs, _ = load_pairs(args.data)
    kept, held = split_by_group(pairs, args.held_out, args.seed, args.max_held_out_groups)
    about = (
        f"held-out source contexts of {', '.join(p.name for p in args.data)}: "
        f"fraction {args.held_out} per task (cap {args.max_held_out_groups}), seed "
        f"{args.seed}; all rows of a context stay together. Calibrate with --exclude-split, "
        "evaluate with --split."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_split(args.out, held, about)
    print(f"wrote {args.out}: {len(held)} held-out rows, {len(kept)} rows left to calibrate on")
    return 0


# -- crop -----------------------------------------------------------------------------------


def _configure_crop(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", nargs="+", required=True, type=Path)
    parser.add_argument("--min-chars", type=int, default=60)
    parser.add_argument("--max-chars", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--suffix", default="short", help="appended to row ids: id~SUFFIX")
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")


def _run_crop(args: argparse.Namespace, engine: Any) -> int:
    pairs, _ = load_pairs(args.data)
    rows, skipped = short_crops(pairs, args.min_chars, args.max_chars, args.seed, args.suffix)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_pairs(args.out, rows)
    groups = len({p.group for p in rows})
    print(
        f"wrote {args.out}: {len(rows)} short rows from {groups} contexts"
        + (f"; {skipped} injected row(s) without an 'attack' field skipped" if skipped else "")
    )
    return 0


# -- threshold -----------------------------------------------------------------------------


def _configure_threshold(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--config", type=Path, required=True, help="model config to re-threshold")
    parser.add_argument("--out", type=Path, required=True, help="config file to write")
    parser.add_argument(
        "--target-fpr",
        type=float,
        default=0.01,
        help="share of these clean rows the new threshold may flag (default 0.01)",
    )


def _run_threshold(args: argparse.Namespace, engine: Any) -> int:
    if not 0.0 <= args.target_fpr < 1.0:
        raise ConfigError(f"--target-fpr must be in [0, 1), got {args.target_fpr}")
    config = read_model_config(args.config)
    model, _ = resolve_model(args.model)
    pairs, _ = load_pairs(args.data)  # unlabelled rows load as label 0: all clean
    if args.max_groups_per_task:
        pairs = sample_groups(pairs, args.max_groups_per_task, args.seed)
    clean = [p for p in pairs if p.label == 0]
    if not clean:
        raise ConfigError(
            f"no clean rows in {', '.join(str(p) for p in args.data)}: the threshold is set on "
            "clean requests (label 0, or rows without labels)"
        )
    clean, table, skipped, _ = scores_for(clean, args, model, config.heads, engine)
    source = ", ".join(p.name for p in args.data)
    new, info = retarget_threshold(
        config, _focus(config, table), args.target_fpr, source, pairs_sha256(clean)
    )
    write_json(args.out, new.model_dump(mode="json"))
    read_model_config(args.out)  # what was written loads and validates
    print(
        f"wrote {args.out}: threshold {info['threshold']:.4f} (was {config.threshold}) on "
        f"{len(clean)} clean rows ({len(skipped)} skipped); the old threshold flagged "
        f"{info['flagged_before']:.1%} of them, the new one flags {info['flagged_after']:.1%}"
    )
    return 0


register(
    Subcommand(
        "calibrate",
        "score labelled rows with every head and write a model config",
        _configure_calibrate,
        _run_calibrate,
    )
)
register(
    Subcommand(
        "evaluate",
        "AUROC, AUPRC and TPR at fixed FPR of model configs on rows, "
        "with a keyword baseline; JSON, markdown and ROC plot",
        _configure_evaluate,
        _run_evaluate,
    )
)
register(
    Subcommand(
        "split",
        "hold out whole source contexts: write a split file (group ids)",
        _configure_split,
        _run_split,
    )
)

register(
    Subcommand(
        "crop",
        "short-data rows: each context's clean data cropped, its attacks put back in "
        "(calibrate on them too when your traffic has short data)",
        _configure_crop,
        _run_crop,
    )
)
register(
    Subcommand(
        "threshold",
        "re-set a model config's threshold on clean requests of your own traffic "
        "(keeps its heads and weights)",
        _configure_threshold,
        _run_threshold,
    )
)
register(Subcommand("steer", "build an activation-steering vector", configure_steer, run_steer))

if __name__ == "__main__":  # vLLM spawns worker processes: keep the guard
    sys.exit(main())
