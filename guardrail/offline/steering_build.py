"""Compute an instruction-following steering vector for a model (``guardrail steer build``,
whose command line is ``guardrail.cli.steer``).

Procedure (Stolfo et al., ICLR 2025, adapted to prompt injection):

1. Examples: clean (instruction, data) rows, each also given an injected copy whose injection
   asks for a checkable *canary* (e.g. "output the word 'HACKED'"). Rows are split by source
   context into a training and a validation side (a held-out split file stays out entirely):
   :mod:`guardrail.offline.steering_examples`.
2. Vector: for every training example, clean and injected, the residual stream at the last
   prompt token *with* the instruction (system message) and *without* it (the data alone), read
   from the serving engine itself at every candidate layer (``HookedLLM.capture_residuals``).
   ``u`` = normalised mean difference, ``avg_proj`` = mean projection of the with-instruction
   streams on ``u``.
3. Layer search, on the validation side: the vector of each candidate layer steers the
   injected prompts, and the score is the teacher-forced gain (log-probability per token,
   steered minus unsteered) of the task's ideal answer over the canary reply, plus the gain of
   the ideal answer on the clean prompts (quality guard). The best layer is written.

Example:
    guardrail steer build --data bipia_*_train_pairs.jsonl --bipia-raw raw/ \\
        --exclude-split docs/bipia_heldout_split.json --out model_configs/
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from guardrail.offline.steering_examples import SteerExample
from guardrail.probe.prompts import RequestLike
from guardrail.steering import (
    SteeringBuildInfo,
    SteeringMetadata,
    SteeringMethod,
    SteeringVector,
    direction_from_pairs,
)

__all__ = [
    "build_steering_vector",
    "default_layers",
    "layer_scores",
    "open_steering_engine",
    "selection_score",
    "vectors_by_layer",
]

SELECTION_METRIC = (
    "validation gain (steered - unsteered, mean log-probability per token) of the ideal answer "
    "minus that of the canary reply on injected prompts, plus the loss (if any, never a gain) "
    "of the ideal answer on clean prompts"
)


# -- vector -------------------------------------------------------------------------------------


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def vectors_by_layer(
    engine: Any,
    examples: Sequence[SteerExample],
    layers: Sequence[int],
    batch_size: int = 16,
) -> dict[int, tuple[torch.Tensor, float, float, int]]:
    """``{layer: (u, avg_proj, mean difference norm, num_pairs)}`` from (with, without
    instruction) pairs of every example, clean and injected, read at the last prompt token by
    the serving engine."""
    with_rows: list[RequestLike] = []
    without_rows: list[RequestLike] = []
    for example in examples:
        for injected in (False, True):
            with_rows.append(example.request(injected, with_instruction=True))
            without_rows.append(example.request(injected, with_instruction=False))
    streams: dict[bool, list[dict[int, torch.Tensor]]] = {True: [], False: []}
    chunks = [(True, c) for c in _batches(with_rows, batch_size)]
    chunks += [(False, c) for c in _batches(without_rows, batch_size)]
    for side, chunk in tqdm(chunks, desc="capture residuals", unit="batch"):
        streams[side].extend(engine.capture_residuals(chunk, layers))
    out = {}
    for layer in layers:
        with_t = torch.stack([s[layer] for s in streams[True]])
        without_t = torch.stack([s[layer] for s in streams[False]])
        u, avg_proj = direction_from_pairs(with_t, without_t)
        out[layer] = (u, avg_proj, float((with_t - without_t).mean(0).norm()), len(with_rows))
    return out


# -- layer search -------------------------------------------------------------------------------


def _mean_logprob(
    engine: Any,
    requests: Sequence[RequestLike],
    continuations: Sequence[str],
    steering: str | None,
) -> np.ndarray:
    logprobs = engine.continuation_logprobs(requests, continuations, steering=steering)
    return np.array([float(np.mean(lp)) if lp else 0.0 for lp in logprobs])


def _validation_logprobs(
    engine: Any, examples: Sequence[SteerExample], steering: str | None
) -> dict[str, np.ndarray]:
    """Per-token log-probabilities: ideal and canary reply on injected prompts, ideal on clean."""
    with_ideal = [e for e in examples if e.ideal is not None]
    return {
        "canary_injected": _mean_logprob(
            engine, [e.request(True) for e in examples], [e.compliant for e in examples], steering
        ),
        "ideal_injected": _mean_logprob(
            engine,
            [e.request(True) for e in with_ideal],
            [str(e.ideal) for e in with_ideal],
            steering,
        ),
        "ideal_clean": _mean_logprob(
            engine,
            [e.request(False) for e in with_ideal],
            [str(e.ideal) for e in with_ideal],
            steering,
        ),
    }


def selection_score(gain: Mapping[str, float]) -> float:
    """The layer-search objective from mean validation gains (see :func:`layer_scores`)."""
    score = gain["ideal_injected"] - gain["canary_injected"] + min(0.0, gain["ideal_clean"])
    return round(score, 10)


def layer_scores(
    engine: Any,
    vectors: dict[int, SteeringVector],
    validation: Sequence[SteerExample],
) -> dict[int, dict[str, float]]:
    """Each layer's validation gains over the unsteered engine; ``score`` is what is maximised:
    mean gain of (ideal - canary) on injected prompts, minus the mean loss of the ideal answer on
    clean prompts. The clean term only penalises: a vector that makes the model more confident
    in everything (the canary too) must not win by that.

    Example:
        >>> selection_score({"ideal_injected": 0.2, "canary_injected": 0.1, "ideal_clean": 0.3})
        0.1
        >>> selection_score({"ideal_injected": 0, "canary_injected": -0.3, "ideal_clean": -0.1})
        0.2
    """
    base = _validation_logprobs(engine, validation, None)
    results = {}
    for layer, vector in tqdm(sorted(vectors.items()), desc="layer search", unit="layer"):
        with engine.steering_vector(vector) as loaded:
            steered = _validation_logprobs(engine, validation, loaded.name)
        gain = {k: float(np.mean(steered[k] - base[k])) for k in base}
        results[layer] = {**gain, "score": selection_score(gain)}
    return results


def build_steering_vector(
    engine: Any,
    train: Sequence[SteerExample],
    validation: Sequence[SteerExample],
    layers: Sequence[int],
    *,
    name: str,
    method: SteeringMethod = "adjust_rs",
    coefficient: float = 1.0,
    dataset: str = "",
    sha256: str = "",
) -> tuple[SteeringVector, dict[int, dict[str, float]]]:
    """Vectors at every candidate layer from ``train``, the best layer on ``validation``.

    Example:
        >>> vec, scores = build_steering_vector(engine, train, val, [6, 9, 12],
        ...                                     name="my-model")  # doctest: +SKIP
    """
    info = engine.model_info
    directions = vectors_by_layer(engine, train, layers)

    def vector(layer: int, scores: dict[int, float] | None = None) -> SteeringVector:
        # candidates get distinct names: a vector of the final name may already be loaded
        u, avg_proj, norm, num_pairs = directions[layer]
        build = SteeringBuildInfo(
            dataset=dataset,
            sha256=sha256,
            num_pairs=num_pairs,
            mean_difference_norm=norm,
            layer_scores=scores or {},
            selection_metric=SELECTION_METRIC if scores else "",
            notes=f"{len(train)} training and {len(validation)} validation contexts",
        )
        meta = SteeringMetadata(
            name=name if scores else f"{name}.candidate-L{layer}",
            model_id=engine.config.model_id,
            layer=layer,
            num_layers=info["num_layers"],
            hidden_size=info["hidden_size"],
            method=method,
            coefficient=coefficient,
            avg_proj=avg_proj,
            build=build,
        )
        return SteeringVector(meta, u.float().contiguous())

    candidates = {layer: vector(layer) for layer in layers}
    scores = layer_scores(engine, candidates, validation)
    best = max(scores, key=lambda layer: scores[layer]["score"])
    return vector(best, {layer: s["score"] for layer, s in scores.items()}), scores


# -- layers and engine -------------------------------------------------------------------------


def default_layers(num_layers: int) -> list[int]:
    """The candidate layers when none are given: every third layer from a fifth of the depth
    to the third-last.

    Example:
        >>> default_layers(30)
        [6, 9, 12, 15, 18, 21, 24, 27]
    """
    return list(range(num_layers // 5, num_layers - 2, 3))


def open_steering_engine(
    model: str | None = None,
    model_id: str | None = None,
    *,
    max_model_len: int = 2048,
    seed: int = 0,
) -> Any:
    """A ``HookedLLM`` to build a vector with (eager: steering needs it), over ``model`` (the
    embedded SmolLM2 when None) with its shipped probe config, or one cheap head when it has
    none; ``model_id`` names the model in the config and the vector. Sets
    ``VLLM_CPU_KVCACHE_SPACE=2`` unless already set."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from guardrail.engine import HookedLLM
    from guardrail.errors import ModelConfigNotFoundError
    from guardrail.probe.config import ModelProbeConfig, load_model_config

    if model is None:
        from guardrail.embedded import EMBEDDED_MODEL_ID, embedded_model_path

        path, default_id = str(embedded_model_path()), EMBEDDED_MODEL_ID
    else:
        path, default_id = model, Path(model).name
    try:
        config = load_model_config(path)
    except ModelConfigNotFoundError:  # building needs no probe: one head keeps it cheap
        config = ModelProbeConfig(model_id=model_id or default_id, heads=[(0, 0)])
    if model_id:
        config = config.model_copy(update={"model_id": model_id})
    return HookedLLM(path, config, enforce_eager=True, max_model_len=max_model_len, seed=seed)
