"""Structured logs: JSON lines (python-json-logger) for the server's logs and one access line per
request, behind `tuneloop serve --log-format json`.

An access line holds the request id (also sent back as `x-request-id`), the method, the route
template, the path (no query string: download URLs carry their signature there), the status,
the seconds taken and the tenant. It never holds a header, a cookie or a body, so never an API
key; and every line, access or not, is masked by `RedactKeys`, which masks anything shaped like
a tuneloop API key (`tml-...`) should a message or a traceback ever quote one.
"""

from __future__ import annotations

import logging
import re
import sys

from pythonjsonlogger.json import JsonFormatter

__all__ = ["ACCESS_LOGGER", "LOG_FORMATS", "RedactKeys", "configure_logging", "log_request"]

ACCESS_LOGGER = "tuneloop.access"
LOG_FORMATS = ("text", "json")
# storage/keys.py: "tml-" + token_urlsafe(32) (43 characters); shorter runs are let through so
# that the word "tml-" in a message stays readable.
_KEY = re.compile(r"tml-[A-Za-z0-9_-]{16,}")
_MASK = "tml-<redacted>"

access = logging.getLogger(ACCESS_LOGGER)


class RedactKeys(logging.Formatter):
    """Wraps a formatter: masks API keys in the whole formatted line (message, fields,
    traceback), whatever put them there."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return _KEY.sub(_MASK, self.inner.format(record))


def json_formatter() -> logging.Formatter:
    """One JSON object per line: time, level, logger, message, and any `extra` fields; keys
    masked."""
    return RedactKeys(
        JsonFormatter(
            ["asctime", "levelname", "name", "message"],
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            datefmt="%Y-%m-%dT%H:%M:%S%z",
        )
    )


def text_formatter() -> logging.Formatter:
    return RedactKeys(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))


def configure_logging(log_format: str, level: int = logging.INFO) -> logging.Handler:
    """Send the server's logs (tuneloop's and uvicorn's) to stderr in `log_format`."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else text_formatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # libraries stay quiet
    logging.getLogger("tuneloop").setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):  # their own handlers would print text lines
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    return handler


def log_request(
    *,
    request_id: str,
    method: str,
    route: str,
    path: str,
    status: int,
    seconds: float,
    tenant: str | None,
) -> None:
    """One access line (see the module docstring for what it holds and never holds)."""
    access.info(
        "%s %s %d",
        method,
        route,
        status,
        extra={
            "request_id": request_id,
            "method": method,
            "route": route,
            "path": path,
            "status": status,
            "latency_s": round(seconds, 6),
            "tenant": tenant,
        },
    )
