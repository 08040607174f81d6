"""Logging for ``proctor serve``: human-readable lines by default, one JSON object per line with
``PROCTOR_LOG_FORMAT=json`` (for log shippers). uvicorn's own loggers go through the same handler."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

__all__ = ["JsonFormatter", "configure_logging"]

# Attributes every LogRecord has; anything else on a record came in through `extra=` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_STANDARD.add("color_message")  # uvicorn's ANSI-coloured copy of the message


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "message": ..., <extra fields>}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str = "info", fmt: Literal["text", "json"] = "text") -> None:
    """One stderr handler on the root logger; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime  # the "Z" in the timestamps
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    # proctor logs each request itself, with the iteration; uvicorn's access log would say it twice.
    logging.getLogger("uvicorn.access").disabled = True
    # httpx says every request it sends at INFO: a standby's forwarded requests would be logged twice over.
    logging.getLogger("httpx").setLevel(logging.WARNING)
