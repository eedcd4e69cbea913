"""The labelled calibration pool that installs with the package (``guardrail/pool``).

``guardrail calibrate`` without ``--data`` calibrates on it. It holds the calibration sources
the shipped SmolLM2 configs were fitted on, one JSONL file each, and a ``manifest.json`` naming
per source its file, row counts, licence, origin, how its rows were selected, and the sha256
of the file. :func:`load_pool` checks every file it reads against that hash, tags each row
with its source (``extra["corpus"]``, the source name also prefixed to its id and group) and
renders it in the ``pair`` layout plus drawn other layouts
(:func:`~guardrail.offline.layouts.with_drawn_layouts`), as ``benchmarks/detection_transfer.py``
built the pool of the shipped configs. Test sets (the hand-written requests, AgentDojo, the
held-out BIPIA split) are not in it.

Example:
    >>> rows = load_pool(["agent_threat_bench"], more_layouts=0)
    >>> len(rows), rows[0].extra["corpus"], rows[0].id.startswith("agent_threat_bench:")
    (31, 'agent_threat_bench', True)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair, load_pairs
from guardrail.offline.layouts import with_drawn_layouts

__all__ = [
    "PoolManifest",
    "PoolSource",
    "added_rows",
    "load_pool",
    "pool_directory",
    "pool_summary",
    "read_manifest",
    "tag_corpus",
]

MANIFEST = "manifest.json"


class PoolSource(BaseModel):
    """One source of the pool, as the manifest describes its file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    file: str
    role: Literal["calibration"]
    clean: int
    injected: int
    groups: int
    licence: str
    origin: str
    selection: str
    sha256: str


class PoolManifest(BaseModel):
    """``guardrail/pool/manifest.json``: what the pool holds and where it came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    about: str
    sources: tuple[PoolSource, ...]

    def source(self, name: str) -> PoolSource:
        for source in self.sources:
            if source.name == name:
                return source
        known = ", ".join(s.name for s in self.sources)
        raise ConfigError(f"no pool source {name!r}; the pool holds {known}")


def pool_directory() -> Path:
    """The installed pool's folder (``guardrail/pool`` of this installation)."""
    return Path(str(files("guardrail.pool")))


def read_manifest(directory: Path | None = None) -> PoolManifest:
    """The manifest of the pool in ``directory`` (default: the installed pool)."""
    path = (directory or pool_directory()) / MANIFEST
    try:
        return PoolManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        raise ConfigError(
            f"cannot read the calibration pool's manifest {path}: {exc}; reinstall "
            "vllm-guardrail, or calibrate on your own rows with --data"
        ) from exc


def _checked_file(directory: Path, source: PoolSource) -> Path:
    path = directory / source.file
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"pool source {source.name}: cannot read {path} ({exc})") from exc
    if digest != source.sha256:
        raise ConfigError(
            f"pool source {source.name}: {path} has sha256 {digest}, the manifest expects "
            f"{source.sha256}; the file was changed after installation: reinstall "
            "vllm-guardrail, or calibrate on your own rows with --data"
        )
    return path


def tag_corpus(pairs: Sequence[LabelledPair], corpus: str) -> list[LabelledPair]:
    """The rows with ``corpus`` prefixed to id and group and set as ``extra["corpus"]`` (so
    rows of two sources never share a group, and reports can split by source).

    Example:
        >>> tag_corpus([LabelledPair("r1", "Q", "d", 0, group="g")], "mine")[0].group
        'mine:g'
    """
    return [
        replace(
            p,
            id=f"{corpus}:{p.id}",
            group=f"{corpus}:{p.group}",
            extra={**p.extra, "corpus": corpus},
        )
        for p in pairs
    ]


def load_pool(
    sources: Sequence[str] | None = None,
    *,
    more_layouts: int = 1,
    directory: Path | None = None,
) -> list[LabelledPair]:
    """The pool's rows of ``sources`` (default: all, in manifest order), each tagged with its
    source and rendered in ``pair`` plus ``more_layouts`` drawn layouts (0 to 2; 1 is what the
    shipped configs were calibrated on). Every file is checked against the manifest's sha256
    first; a mismatch raises ``ConfigError``.
    """
    directory = directory or pool_directory()
    manifest = read_manifest(directory)
    chosen = list(manifest.sources) if sources is None else [manifest.source(n) for n in sources]
    rows: list[LabelledPair] = []
    for source in chosen:
        pairs, labelled = load_pairs(_checked_file(directory, source))
        if not labelled:
            raise ConfigError(f"pool source {source.name}: rows without labels")
        rows += with_drawn_layouts(tag_corpus(pairs, source.name), more_layouts)
    return rows


def added_rows(paths: Sequence[str | Path], more_layouts: int = 1) -> list[LabelledPair]:
    """Labelled rows of your own to calibrate on next to the pool's (``guardrail calibrate
    --add-data``): each row's source is its ``corpus`` field, else its file's stem (a row whose
    ``corpus`` names a pool source joins that source: its ``source`` then names the pool
    row's group it belongs with), tagged and rendered in ``pair`` plus ``more_layouts`` drawn
    layouts like the pool's own rows (:func:`load_pool`).

    Example:
        >>> rows = added_rows(["my_tool_outputs.jsonl"])  # doctest: +SKIP
        >>> rows[0].extra["corpus"], rows[0].extra["layout"]  # doctest: +SKIP
        ('my_tool_outputs', 'pair')
    """
    rows: list[LabelledPair] = []
    for path in map(Path, paths):
        pairs, labelled = load_pairs(path)
        if not labelled:
            raise ConfigError(
                f"--add-data {path}: rows without labels; label every row (0 clean, 1 injected)"
            )
        by_source: dict[str, list[LabelledPair]] = {}
        for pair in pairs:
            corpus = pair.extra.get("corpus", path.stem)
            if not isinstance(corpus, str) or not corpus:
                raise ConfigError(f"--add-data {path}: row {pair.id}: 'corpus' must be a name")
            by_source.setdefault(corpus, []).append(pair)
        for corpus, group in by_source.items():
            rows += with_drawn_layouts(tag_corpus(group, corpus), more_layouts)
    return rows


def pool_summary(rows: Sequence[LabelledPair], directory: Path | None = None) -> list[str]:
    """One line per source of ``rows`` (pool rows, as :func:`load_pool` returns them): its
    rows clean / injected, file and licence, from the manifest."""
    manifest = read_manifest(directory)
    lines = []
    for source in manifest.sources:
        labels = [p.label for p in rows if p.extra.get("corpus") == source.name]
        if labels:
            lines.append(
                f"{source.name}: {len(labels)} rows ({labels.count(0)} clean / "
                f"{labels.count(1)} injected) from {source.file}; licence: {source.licence}"
            )
    return lines
