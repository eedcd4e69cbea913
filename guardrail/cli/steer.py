"""``guardrail steer build``: build an activation-steering vector and write its file.

The command line only: the procedure is the library's, the examples in
:mod:`guardrail.offline.steering_examples`, vectors and the layer search in
:mod:`guardrail.offline.steering_build`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from guardrail.console import HelpFormatter
from guardrail.offline.row_schema import rows_help
from guardrail.offline.steering_build import (
    build_steering_vector,
    default_layers,
    open_steering_engine,
)
from guardrail.offline.steering_examples import select_examples

__all__ = ["configure", "layer_list", "run"]


def layer_list(text: str) -> list[int]:
    """``"6:27:3"`` (start:stop:step) or ``"6,9,12"``.

    Example:
        >>> layer_list("6:15:3"), layer_list("1,3")
        ([6, 9, 12], [1, 3])
    """
    if ":" in text:
        start, stop, *step = (int(x) for x in text.split(":"))
        return list(range(start, stop, step[0] if step else 1))
    return [int(x) for x in text.split(",")]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``guardrail steer`` (one action for now: ``build``)."""
    actions = parser.add_subparsers(dest="steer_action", required=True, metavar="ACTION")
    build = actions.add_parser(
        "build",
        help="compute a steering vector and write its file",
        description="Compute a steering vector from clean rows and write its file.",
        formatter_class=HelpFormatter,
        epilog=rows_help(
            (("ideal", "reference answer to the instruction (or --bipia-raw); clean rows only"),)
        ),
    )
    build.add_argument(
        "--data", nargs="+", required=True, type=Path, help="JSONL files of rows (format: below)"
    )
    build.add_argument("--out", required=True, type=Path, help="directory for the .steer file")
    build.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M)")
    build.add_argument("--model-id", help="model id recorded in the file (default: derived)")
    build.add_argument("--name", help="vector name (default: last part of the model id)")
    build.add_argument(
        "--bipia-raw",
        type=Path,
        help="BIPIA raw/ dir: reference answers by source context (default: none, each row's "
        "ideal field)",
    )
    build.add_argument(
        "--exclude-split",
        type=Path,
        help="split file whose groups stay out (default: none)",
    )
    build.add_argument(
        "--layers",
        type=layer_list,
        help="candidate layers, start:stop:step or a,b,c (default: every third layer from L/5)",
    )
    build.add_argument(
        "--method",
        choices=["adjust_rs", "add_vector"],
        default="adjust_rs",
        help="adjust_rs sets the stream's projection on the vector to c * avg_proj; add_vector "
        "adds c times the vector",
    )
    build.add_argument("--coefficient", type=float, default=1.0, help="c of --method")
    build.add_argument(
        "--max-data-chars", type=int, default=1200, help="rows with longer data are left out"
    )
    build.add_argument(
        "--train-per-task", type=int, default=16, help="rows per task the vector is built from"
    )
    build.add_argument(
        "--validation-per-task",
        type=int,
        default=8,
        help="rows per task (other source contexts) the layer is picked on",
    )
    build.add_argument("--seed", type=int, default=0, help="seed of the row draw and injections")
    build.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len")


def _dataset(args: argparse.Namespace) -> str:
    """What the vector's file says it was built from."""
    files = ", ".join(p.name for p in args.data)
    held = args.exclude_split
    return f"{files}: clean rows with generated canary injections" + (
        f", minus the held-out groups of {held.name}" if held else ""
    )


def run(args: argparse.Namespace, engine: Any = None) -> int:
    """Run ``guardrail steer build``; ``engine`` reuses a started ``HookedLLM`` (tests)."""
    train, validation, sha = select_examples(
        args.data,
        exclude_split=args.exclude_split,
        bipia_raw=args.bipia_raw,
        max_data_chars=args.max_data_chars,
        train_per_task=args.train_per_task,
        validation_per_task=args.validation_per_task,
        seed=args.seed,
    )
    own = engine is None
    if own:
        engine = open_steering_engine(
            args.model, args.model_id, max_model_len=args.max_model_len, seed=args.seed
        )
    try:
        layers = args.layers or default_layers(engine.model_info["num_layers"])
        name = args.name or engine.config.model_id.split("/")[-1]
        vector, scores = build_steering_vector(
            engine,
            train,
            validation,
            layers,
            name=name,
            method=args.method,
            coefficient=args.coefficient,
            dataset=_dataset(args),
            sha256=sha,
        )
    finally:
        if own:
            engine.close()
    args.out.mkdir(parents=True, exist_ok=True)
    path = vector.save(args.out / f"{name}.steer.safetensors")
    for layer, s in sorted(scores.items()):
        print(
            f"layer {layer:3d}: score {s['score']:+.4f}  "
            + "  ".join(f"{k} {v:+.4f}" for k, v in s.items() if k != "score")
        )
    print(f"wrote {path}: layer {vector.layer}, avg_proj {vector.metadata.avg_proj:.3f}")
    return 0
