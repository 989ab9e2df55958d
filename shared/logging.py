"""structlog setup: JSON lines for services, readable output on a terminal.

Request and replica ids travel in structlog's contextvars, so every line logged while handling a
request carries them: `bind_contextvars(request_id=..., replica_id=...)`.
"""

from __future__ import annotations

import logging
import sys

import structlog

from shared import logstream


def configure_logging(service: str, fmt: str = "auto", level: str = "info", **static) -> structlog.BoundLogger:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            logstream.TAP,  # inert until the service publishes its lines (shared.logstream)
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service, **static)
    return structlog.get_logger()


def get_logger(**initial) -> structlog.BoundLogger:
    return structlog.get_logger(**initial)
