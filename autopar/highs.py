"""HiGHS models that keep quiet: the solver's banner and log go to stdout only when the
`passes` log component is at DEBUG (AUTOPAR_LOGS=+passes).

HiGHS prints its banner from the C++ constructor of the first model in a process, before
any option can be set, so that one construction runs with file descriptor 1 pointed at
/dev/null (Python's own sys.stdout is flushed first and is not touched).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import highspy

log = logging.getLogger("autopar.passes")
_constructed = False


def new_model() -> highspy.Highs:
    """An empty HiGHS model, silent unless the passes log asks for the solver's output."""
    global _constructed  # NOTE: HiGHS's own per-process state: its banner prints once
    verbose = log.isEnabledFor(logging.DEBUG)
    if verbose or _constructed:
        h = highspy.Highs()
    else:
        with _stdout_to_devnull():
            h = highspy.Highs()
    _constructed = True
    h.setOptionValue("output_flag", verbose)
    return h


@contextlib.contextmanager
def _stdout_to_devnull():
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
