"""structlog set-up shared by the controller and daemons: key=value lines (or JSON) on stderr.

Knows only logging; callers bind role, rank and call ids themselves.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: str = "info", fmt: str = "console") -> None:
    """Route structlog to stderr at `level`; fmt is "console" (key=value) or "json"."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger("hfrt").bind(**bound)
