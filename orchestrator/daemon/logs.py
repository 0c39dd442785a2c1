"""One `configure_logging()`: JSON lines when stderr is not a TTY, console on a TTY."""

from __future__ import annotations

import logging
import sys

import structlog

from messages import liblog


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())  # no ANSI into a file
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # The library's own lines (messages.liblog: trainer client, group members) at the
    # same level, on stderr.
    lib = logging.getLogger(liblog.ROOT)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    lib.handlers = [handler]
    lib.setLevel(getattr(logging, level.upper(), logging.INFO))
    lib.propagate = False
    liblog.use(json, colors=not json and sys.stderr.isatty())
