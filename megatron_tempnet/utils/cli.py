"""What every command-line program of the project shares: user errors become one line.

A mistake in the user's input (a flag, a file, a checkpoint, a dataset) raises a ``UserError``
subclass whose message names the input and the fix; ``run_tool`` prints it as ``error: ...`` on
standard error and exits with status 1, without a traceback. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
import warnings
from collections.abc import Callable

# megatron-core warns that the optional GPU accelerators (apex, Transformer Engine) are absent
ABSENT_ACCELERATORS = r"(Transformer Engine and )?Apex (is|are) not installed"


class UserError(Exception):
    """A mistake in the user's input; the message names the flag or file, its value and the fix."""


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped a tool; it removed the partial outputs it had written."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def run_tool(main: Callable[[], int]) -> int:
    """Run a program's ``main`` with logging set up; returns its exit status.

    A ``UserError`` prints one line and gives status 1; an ``Interrupted`` gives 128 + signal.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    warnings.filterwarnings("ignore", message=ABSENT_ACCELERATORS)
    try:
        return main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"error: {e}; partial outputs were removed", file=sys.stderr)
        return 128 + e.signum
