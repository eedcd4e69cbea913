"""Run several ``examples/*.py`` scripts in this one process, one after another, each as
``python examples/NAME ARGS`` runs it: ``sys.argv`` set, the file run as ``__main__``, the
example starting (and closing) its own engine. tests/engine/test_examples.py runs most examples
this way, with vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so Python's and
vLLM's imports are paid once and no engine process is spawned per example.

    python tests/engine/_example_runner.py JOBS.json

``JOBS.json`` is a list of ``[name, [arg, ...]]``. Each example's output is framed by the lines
``@@example NAME`` and ``@@exit NAME CODE SECONDS``, on stdout and on stderr alike; CODE is 0,
the code of a ``SystemExit``, or 1 after an exception (its traceback goes to stderr). A failed
example does not stop the ones after it.
"""

from __future__ import annotations

import json
import runpy
import sys
import time
import traceback
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def frame(line: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        print(line, file=stream, flush=True)


def run_one(name: str, args: list[str]) -> int:
    """Run ``examples/<name>`` as its ``__main__``; its exit code."""
    path = EXAMPLES / name
    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:  # as the interpreter treats it: a message is printed, exit 1
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr, flush=True)
        return 1
    except Exception:  # the example failed: reported, and the next one runs
        traceback.print_exc()
        return 1
    finally:
        sys.argv = argv
    return 0


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    for name, args in jobs:
        frame(f"@@example {name}")
        started = time.monotonic()
        code = run_one(name, [str(a) for a in args])
        frame(f"@@exit {name} {code} {time.monotonic() - started:.0f}")


if __name__ == "__main__":  # vLLM's CPU engine processes (if any) spawn: they import this again
    main()
