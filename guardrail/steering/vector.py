"""Steering vector files: safetensors with one tensor and validated metadata.

Vectors are safetensors files (one tensor, ``direction``) whose metadata holds a
:class:`SteeringMetadata` as JSON: model id, layer, hidden size, dtype, method, coefficient,
avg_proj and how it was built. No pickles, no paths. The math is in ``guardrail.steering.math``.

Example:
    >>> sorted(packaged_steering_vectors())  # doctest: +SKIP
    ['SmolLM2-135M-Instruct']
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, field_validator

from guardrail.errors import ConfigError
from guardrail.steering.math import SteeringMethod
from guardrail.strict import ConfigModel, FiniteNumber, SchemaVersion, WholeNumber

__all__ = [
    "STEERING_SUFFIX",
    "SteeringBuildInfo",
    "SteeringMetadata",
    "SteeringVector",
    "load_steering_vector",
    "packaged_steering_vectors",
]

STEERING_SUFFIX = ".steer.safetensors"
METADATA_KEY = "guardrail_steering"
TENSOR_NAME = "direction"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_METADATA_CHARS = 1_000_000
"""A steering file's metadata JSON above this length is refused (real ones are ~2 kB)."""


def _relative(value: str) -> str:
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute():
        raise ValueError(f"absolute paths are not stored in steering files, got {value!r}")
    return value


class SteeringBuildInfo(ConfigModel):
    """How a vector was built, for audit (relative descriptions only, no absolute paths)."""

    dataset: str
    sha256: str = ""
    num_pairs: WholeNumber = Field(ge=0)
    # |mean(with - without)|: a scale for add_vector
    mean_difference_norm: FiniteNumber | None = Field(default=None, ge=0.0)
    position: Literal["last_prompt_token"] = "last_prompt_token"
    # layer -> validation metric (JSON object keys are strings: "12" is layer 12)
    layer_scores: dict[Annotated[int, Field(ge=0)], FiniteNumber] = Field(default_factory=dict)
    selection_metric: str = ""
    tool: str = "guardrail steer build"
    notes: str = ""

    _no_paths = field_validator("dataset", "notes")(_relative)


class SteeringMetadata(ConfigModel):
    """What a steering file says about its vector; checked against the served model on load.

    Numbers are strict and finite: a bool, a string, NaN or infinity is a ``ConfigError``
    naming the field, when the metadata is built and when a file is loaded.
    """

    schema_version: SchemaVersion = 1
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    model_id: str = Field(min_length=1)
    layer: WholeNumber = Field(ge=0)
    num_layers: WholeNumber | None = Field(default=None, ge=1)
    hidden_size: WholeNumber = Field(ge=1)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    method: SteeringMethod = "add_vector"
    coefficient: FiniteNumber = 1.0
    avg_proj: FiniteNumber
    build: SteeringBuildInfo | None = None


@dataclass(frozen=True)
class SteeringVector:
    """A unit direction ``[hidden_size]`` at one layer, with its metadata.

    Example:
        >>> meta = SteeringMetadata(name="demo", model_id="tiny", layer=1, hidden_size=2,
        ...                         avg_proj=1.5)
        >>> vec = SteeringVector(meta, torch.tensor([0.0, 1.0]))
        >>> vec.check_model("tiny", hidden_size=2, num_layers=4)
    """

    metadata: SteeringMetadata
    direction: torch.Tensor

    def __post_init__(self) -> None:
        meta, u = self.metadata, self.direction
        if u.shape != (meta.hidden_size,):
            raise ConfigError(
                f"steering vector {meta.name!r}: tensor shape {tuple(u.shape)}, metadata says "
                f"hidden_size {meta.hidden_size}; expected a [{meta.hidden_size}] tensor"
            )
        if u.dtype != _DTYPES[meta.dtype]:
            raise ConfigError(
                f"steering vector {meta.name!r}: tensor dtype {u.dtype}, metadata says {meta.dtype}"
            )
        norm = float(u.float().norm())
        if not math.isfinite(norm) or abs(norm - 1.0) > 1e-3:
            raise ConfigError(
                f"steering vector {meta.name!r}: direction norm {norm:.6f}, expected a unit "
                "vector (1.0); normalise it before saving"
            )
        if meta.num_layers is not None and meta.layer >= meta.num_layers:
            raise ConfigError(
                f"steering vector {meta.name!r}: layer {meta.layer} >= num_layers {meta.num_layers}"
            )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def layer(self) -> int:
        return self.metadata.layer

    def fingerprint(self) -> str:
        """sha256 over the tensor bytes and the fields that change what steering does."""
        digest = hashlib.sha256(self.direction.float().contiguous().numpy().tobytes())
        meta = self.metadata
        digest.update(f"{meta.model_id}|{meta.layer}|{meta.avg_proj!r}".encode())
        return digest.hexdigest()

    def check_model(self, model_id: str, hidden_size: int, num_layers: int) -> None:
        """Raise ``ConfigError`` unless this vector was built for this model.

        Example:
            >>> vec.check_model("other/model", 2, 4)  # doctest: +SKIP
            Traceback (most recent call last):
            guardrail.errors.ConfigError: steering vector 'demo' was built for model 'tiny' ...
        """
        meta = self.metadata
        problems = []
        if meta.model_id != model_id:
            problems.append(f"model id {meta.model_id!r}, serving {model_id!r}")
        if meta.hidden_size != hidden_size:
            problems.append(f"hidden size {meta.hidden_size}, model has {hidden_size}")
        if meta.layer >= num_layers:
            problems.append(f"layer {meta.layer}, model has {num_layers} layers")
        if meta.num_layers is not None and meta.num_layers != num_layers:
            problems.append(f"built on {meta.num_layers} layers, model has {num_layers}")
        if problems:
            raise ConfigError(
                f"steering vector {meta.name!r} was built for model {meta.model_id!r} and does "
                f"not fit the served model ({'; '.join(problems)}); build one for this model "
                "with `guardrail steer build --model MODEL ...`"
            )

    def save(self, path: str | Path) -> Path:
        """Write the vector as a safetensors file (metadata as JSON in the file header)."""
        from safetensors.torch import save_file

        path = Path(path)
        payload = {METADATA_KEY: self.metadata.model_dump_json()}
        save_file({TENSOR_NAME: self.direction.contiguous()}, str(path), metadata=payload)
        return path

    @classmethod
    def load(cls, path: str | Path) -> SteeringVector:
        """Read and validate a steering file; ``ConfigError`` names the file and the problem.

        Example:
            >>> vec = SteeringVector.load("model_configs/X.steer.safetensors")  # doctest: +SKIP
        """
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
                names = list(handle.keys())
                if names != [TENSOR_NAME]:
                    raise ConfigError(
                        f"expected one tensor named {TENSOR_NAME!r}, found {sorted(names)}"
                    )
                direction = handle.get_tensor(TENSOR_NAME)
            if METADATA_KEY not in header:
                raise ConfigError(f"no {METADATA_KEY!r} metadata in the file header")
            metadata = SteeringMetadata.model_validate(_metadata_json(header[METADATA_KEY]))
            return cls(metadata, direction)
        except (OSError, SafetensorError) as exc:
            raise ConfigError(f"invalid steering file {path}: {exc}") from exc
        except ConfigError as exc:
            raise ConfigError(f"invalid steering file {path}: {exc}") from exc


def _metadata_json(text: str) -> Any:
    """The metadata JSON of a steering file, or ``ConfigError`` saying what is wrong with it."""
    if len(text) > MAX_METADATA_CHARS:
        raise ConfigError(
            f"{METADATA_KEY!r} metadata is {len(text)} characters, over the "
            f"{MAX_METADATA_CHARS} allowed (real metadata is a few kB)"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{METADATA_KEY!r} metadata is not valid JSON: {exc.msg} at column {exc.colno}"
        ) from exc
    except RecursionError:
        raise ConfigError(f"{METADATA_KEY!r} metadata JSON is nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer of over 4300 digits
        raise ConfigError(f"{METADATA_KEY!r} metadata JSON cannot be read: {exc}") from exc


def packaged_steering_vectors() -> dict[str, Path]:
    """Steering files shipped in ``guardrail.model_configs``, by vector name (file stem)."""
    root = resources.files("guardrail.model_configs")
    files = (Path(str(p)) for p in root.iterdir() if p.name.endswith(STEERING_SUFFIX))
    return {p.name[: -len(STEERING_SUFFIX)]: p for p in sorted(files)}


def load_steering_vector(vector: str | Path | SteeringVector) -> SteeringVector:
    """A vector from an object, a file path, or the name of a shipped vector.

    Example:
        >>> load_steering_vector("SmolLM2-135M-Instruct").layer  # doctest: +SKIP
        12
    """
    if isinstance(vector, SteeringVector):
        return vector
    shipped = packaged_steering_vectors()
    if isinstance(vector, str) and vector in shipped:
        return SteeringVector.load(shipped[vector])
    path = Path(vector)
    if path.is_file():
        return SteeringVector.load(path)
    raise ConfigError(
        f"no steering vector {str(vector)!r}: not a file and not a shipped vector "
        f"(shipped: {sorted(shipped)}); build one with `guardrail steer build`"
    )
