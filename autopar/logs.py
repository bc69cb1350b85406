"""Logging switches, in the spirit of TORCH_LOGS.

AUTOPAR_LOGS is a comma-separated list of components: `passes` logs at INFO,
`+passes` at DEBUG, `-passes` only errors; `all` / `+all` switch every component.
Components: trace, passes, runtime, planner, cli. Example:

    AUTOPAR_LOGS=+passes,runtime torchrun --nproc-per-node 2 train.py

Without it autopar logs warnings only. Read once at the entry points
(`autopar.compile`, the CLI).
"""

from __future__ import annotations

import json
import logging
import os

COMPONENTS = ("trace", "passes", "runtime", "planner", "cli")
_LEVELS = {"+": logging.DEBUG, "-": logging.ERROR, "": logging.INFO}


class LogSpecError(ValueError):
    pass


def parse(spec: str) -> dict[str, int]:
    levels: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        sign = item[0] if item[0] in "+-" else ""
        name = item[len(sign):]
        names = COMPONENTS if name == "all" else (name,)
        if name != "all" and name not in COMPONENTS:
            raise LogSpecError(f"AUTOPAR_LOGS: unknown component {name!r}; known: "
                               f"{', '.join(COMPONENTS)}, all")
        for n in names:
            levels[n] = _LEVELS[sign]
    return levels


def configure(spec: str) -> None:
    root = logging.getLogger("autopar")
    if not root.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}] " if rank is not None else ""
        handler.setFormatter(logging.Formatter(prefix + "%(asctime)s %(name)s %(levelname)s %(message)s",
                                               "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    for name, level in parse(spec).items():
        logging.getLogger(f"autopar.{name}").setLevel(level)


def configure_from_env() -> None:
    configure(os.environ.get("AUTOPAR_LOGS", ""))


# -- progress events of the workers `autopar train` starts ----------------------------------

EVENT_PREFIX = "@autopar-event "


def emit(event: str, **fields) -> None:
    """An event as one JSON line on stdout, which the CLI shows: rank 0's progress, and
    any rank's refusal of the layout (train_worker.refuse)."""
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)
