"""The library's own logger: what a trainer's script imports logs through stdlib `logging`
(logger "weightsync"), never to the script's stdout.

Rules: a library does not configure logging. Unconfigured, Python prints warnings and
errors on stderr (`logging.lastResort`) and drops the rest; an application that wants the
library's info lines configures the "weightsync" logger (or the root logger). The
`weightsync` commands do so in `configure_logging`. Lines read `event key=value ...`.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

ROOT = "weightsync"


def get_logger(name: str) -> Any:
    """A structlog logger over stdlib logger `weightsync.<name>`."""
    return structlog.wrap_logger(
        logging.getLogger(f"{ROOT}.{name}"),
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
