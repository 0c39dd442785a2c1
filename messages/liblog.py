"""The library's own logger: what a trainer's script imports logs through stdlib `logging`
(logger "weightsync"), never to the script's stdout.

Rules: a library does not configure logging. Unconfigured, Python prints warnings and
errors on stderr (`logging.lastResort`) and drops the rest; an application that wants the
library's info lines configures the "weightsync" logger (or the root logger). Lines read
`event key=value ...`; a `weightsync` process (daemon, engine, CLI) calls `use(json=...)`
from its `configure_logging`, so these lines match its own (JSON lines in a log file).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

ROOT = "weightsync"

# The rendering chain every library logger runs (changed in place by `use`).
_CHAIN: list[Any] = [
    structlog.processors.format_exc_info,
    structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0),
]


def use(json: bool, colors: bool = False) -> None:
    """Render the library's lines as this process renders its own."""
    if json:
        _CHAIN[:] = [
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        _CHAIN[:] = [
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=0),
        ]


def _render(logger: Any, method: str, event: Any) -> Any:
    for proc in _CHAIN:
        event = proc(logger, method, event)
    return event


def get_logger(name: str) -> Any:
    """A structlog logger over stdlib logger `weightsync.<name>`."""
    return structlog.wrap_logger(
        logging.getLogger(f"{ROOT}.{name}"),
        processors=[structlog.stdlib.filter_by_level, _render],
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
