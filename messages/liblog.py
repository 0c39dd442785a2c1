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
from structlog.typing import EventDict, Processor, ProcessorReturnValue, WrappedLogger

ROOT = "weightsync"

# The rendering chain every library logger runs (changed in place by `use`).
_CHAIN: list[Processor] = [
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


def _render(logger: WrappedLogger, method: str, event: EventDict) -> ProcessorReturnValue:
    # Each processor takes what the one before it returned (an event dict; the last one
    # renders it to a str): a hand-over structlog's types cannot state, so it is untyped.
    out: Any = event
    for proc in _CHAIN:
        out = proc(logger, method, out)
    rendered: ProcessorReturnValue = out
    return rendered


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger over stdlib logger `weightsync.<name>`: a lazy proxy that binds
    a `structlog.stdlib.BoundLogger` on first use and answers as one."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(f"{ROOT}.{name}"),
        processors=[structlog.stdlib.filter_by_level, _render],
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return logger
