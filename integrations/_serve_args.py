"""The ``guardrail-serve`` command line: its own options, and vLLM's engine flags after them.

:func:`own_parser` holds the server's own options alone and imports neither vLLM nor torch, so
it answers ``--help`` and ``--version`` at once (``_serve_command.main``); :func:`build_parser`
adds vLLM's engine flags (``--help=all`` lists them) and is what ``serving.parse_command`` reads.

Example:
    >>> own_parser().parse_args(["/models/m", "--port", "9001"]).port
    9001
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from guardrail.console import HelpFormatter, StatedDefaultsFormatter
from guardrail.errors import ConfigError
from guardrail.version import __version__

from ._server_gate import DEFAULT_MAX_BODY_BYTES

__all__ = ["add_serve_arguments", "build_parser", "chat_template_text", "own_parser"]

PROG = "guardrail-serve"
DESCRIPTION = (
    "The guarded OpenAI-compatible server on one model: guardrail-serve [MODEL] [options]. "
    "Its own options come first; the engine takes the flags of `vllm serve`."
)
ENGINE_FLAGS = (
    "Engine flags: every flag of `vllm serve` (vLLM's engine arguments): --max-model-len, "
    "--dtype, --tensor-parallel-size (-tp), --enforce-eager, --compilation-config.mode, "
    "--served-model-name, --config FILE.yaml, ... Only the flags you give reach vLLM; on CPU "
    "the library fills in the rest (float32, eager mode, a KV cache size), on a GPU vLLM's own "
    "defaults apply. `guardrail-serve --help=all` lists every flag with its default, "
    "--help=GROUP one group (e.g. --help=CacheConfig), --help=WORD the flags whose name holds "
    "WORD; those import vLLM (several seconds). docs/serving.md has the migration table from "
    "`vllm serve`."
)


def _engine_arg(text: str) -> tuple[str, Any]:
    # guardrail.engine imports torch and vLLM: only a command line that uses the flag pays it
    from guardrail.engine.install import engine_arg

    return engine_arg(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and ``guardrail-serve``'s own options (not vLLM's), on ``parser``."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="model path or hub id, as in `vllm serve MODEL`, or --model (default: the "
        "embedded SmolLM2-135M-Instruct)",
    )
    own = parser.add_argument_group(PROG)
    own.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    own.add_argument(
        "--probe-config",
        default=None,
        help="the model's probe config: a JSON file, or a shipped variant (e.g. combined) "
        "(default: the config shipped for the model and the engine's mode)",
    )
    own.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="block requests whose focus is at or below this (default: the probe config's "
        "threshold)",
    )
    own.add_argument(
        "--policies",
        type=Path,
        default=None,
        metavar="FILE",
        help="the policies, as a JSON or YAML file (docs/serving.md; schema: "
        "docs/policies.schema.json), with named sets a request picks by header; instead of "
        "--threshold (default: block_injections, blocking at the probe config's threshold)",
    )
    own.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every /v1 request, as `vllm serve "
        "--api-key` (default: $VLLM_API_KEY; unset: no key needed)",
    )
    own.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get a 413",
    )
    own.add_argument(
        "--data-between",
        nargs=2,
        metavar=("START", "END"),
        default=None,
        help="mark text from the first START to the last END of each message as untrusted "
        "data (e.g. '<documents>' '</documents>' around pasted retrieval results), with no "
        "client change; docs/serving.md says its limits (default: none, data is marked by "
        "message roles and content parts)",
    )
    own.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model may call the request\'s tools, its calls read '
        "by --tool-call-parser, as `vllm serve` (default: off; tools are then rendered only "
        'with tool_choice "none")',
    )
    own.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="vLLM's tool parser for the model's calls (e.g. hermes, llama3_json, mistral), "
        "as `vllm serve` (default: none)",
    )
    own.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the Jinja chat template that renders every request, a file or the template "
        "itself, as `vllm serve` (e.g. one that renders tools for a model whose own does not); "
        "the probe's spans are placed while it renders, and the model's config was calibrated "
        "on its own template: check the threshold on your traffic (default: the model's own)",
    )
    own.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="the role of every chat answer, as `vllm serve` (default: assistant)",
    )
    own.add_argument("--host", default="127.0.0.1", help="address to listen on")
    own.add_argument("--port", type=int, default=8000, help="port to listen on")
    own.add_argument("--max-tokens", type=int, default=256, help="when a request sets none")
    own.add_argument("--verbose", action="store_true", help="show vLLM's logs")
    own.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="deprecated: pass vLLM's own flag instead (--engine-arg max_model_len=4096 is "
        "--max-model-len 4096) (default: none)",
    )


def own_parser() -> argparse.ArgumentParser:
    """``guardrail-serve``'s own options only, and where the engine flags are described; no
    vLLM import. It answers ``--help`` and ``--version``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, epilog=ENGINE_FLAGS, formatter_class=HelpFormatter
    )
    add_serve_arguments(parser)
    return parser


def build_parser() -> Any:
    """The full parser: the server's own options, then vLLM's engine flags, added by vLLM's
    own ``AsyncEngineArgs.add_cli_args`` on vLLM's ``FlexibleArgumentParser`` (so
    ``--max-model-len 4096``, ``--max_model_len=4096``, ``-tp 2``, ``--compilation-config.mode 0``
    and ``--config FILE.yaml`` work as with ``vllm serve``). Imports vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser, SortedHelpFormatter

    # vLLM's layout, with this library's rule for defaults (never print an environment value)
    formatter = type("ServeHelpFormatter", (StatedDefaultsFormatter, SortedHelpFormatter), {})
    parser = FlexibleArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=formatter)
    add_serve_arguments(parser)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def chat_template_text(value: str | None) -> str | None:
    """``--chat-template``'s template: the file's text, or the value itself when it is a Jinja
    template (as ``vllm serve`` reads it); None when not given. Checked at start-up: a missing
    file or a template that does not parse is a ``ConfigError`` naming the flag.

    Example:
        >>> chat_template_text("{% for m in messages %}{{ m.content }}{% endfor %}")[:6]
        '{% for'
        >>> chat_template_text("templates/none.jinja")
        Traceback (most recent call last):
        ...
        guardrail.errors.ConfigError: --chat-template 'templates/none.jinja': no such file, and \
not a Jinja template (give a template file or the template's text)
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ConfigError(
            f"--chat-template {value!r}: no such file, and not a Jinja template (give a "
            "template file or the template's text)"
        )
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ConfigError(
            f"--chat-template {value!r}: the template does not parse: {exc.message} "
            f"(line {exc.lineno})"
        ) from None
    return text
