"""Logging set-up: readable lines on a terminal, JSON lines for the journal.

Under systemd (``$JOURNAL_STREAM`` is set: stderr goes to the journal) or
with ``--log-json``, each record is one JSON object — time, level, logger,
message, and the process — so the journal (and anything reading it) gets
structured fields; the level is INFO there, so start-up, draining and
refused peers are on record.
"""

from __future__ import annotations

import json
import logging
import os
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup(*, verbose: bool, json_lines: bool | None = None) -> None:
    if json_lines is None:
        json_lines = bool(os.environ.get("JOURNAL_STREAM"))
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
        level = logging.DEBUG if verbose else logging.INFO
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        level = logging.DEBUG if verbose else logging.WARNING
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
