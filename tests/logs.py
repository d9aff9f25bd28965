"""What zero3 logs in a test's rank, kept for the test to read."""

from __future__ import annotations

import logging


def zero3_messages(level: int = logging.NOTSET) -> list[str]:
    """From now on in this process, the message of every record at `level` or above that reaches the
    "zero3" logger, in order (a rank's process ends with its test, and the handler with it)."""
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zero3").addHandler(handler)
    return messages
