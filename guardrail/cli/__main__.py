"""``python -m guardrail.cli``: the ``guardrail`` command."""

import sys

from guardrail.cli import main

if __name__ == "__main__":  # vLLM spawns worker processes: keep the guard
    sys.exit(main())
