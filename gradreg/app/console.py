"""The console and the run's log file: what the console shows, the log file holds.

Hydra's job logging writes the records of the root logger to the console and to the run's log
file (``train.log`` in the run folder). Two kinds of output would miss the file: the app's own
lines, printed as they are (the final metrics, where the files went, the resume and error
lines), and Lightning's records, which its ``lightning`` logger prints with a console handler of
its own. :func:`say` prints a line and writes it to the log file; :func:`route_lightning`
gives Lightning's loggers the log file too, and keeps their records from reaching the console
twice.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

#: The logger of the app's own lines in the log file (its records go to no console).
LINES = logging.getLogger("gradreg.app.console")
LINES.propagate = False

#: Lightning's loggers, each of which may hold a console handler of its own.
LIGHTNING = ("lightning.pytorch", "lightning.fabric", "lightning")


def log_files() -> list[logging.FileHandler]:
    """The root logger's file handlers: the run's log file where Hydra's job logging is on."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def say(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` to ``stream`` (stdout) and write each of its lines to the log file (level
    ERROR for stderr, else INFO)."""
    stream = sys.stdout if stream is None else stream
    print(text, file=stream, flush=True)
    level = logging.ERROR if stream is sys.stderr else logging.INFO
    files = log_files()
    for line in text.splitlines():
        if line.strip():
            record = LINES.makeRecord(LINES.name, level, __file__, 0, line, None, None)
            for handler in files:
                handler.handle(record)


def route_lightning(*filters: logging.Filter) -> None:
    """Lightning's records on the console once, as Lightning prints them, and in the log file.

    A Lightning logger with a console handler of its own stops passing its records on (the root
    logger's console would print them again) and gets the log file's handlers instead; file
    handlers of an earlier run in this process are dropped. ``filters`` are added to each logger
    and to its handlers (a record a child logger passes up meets only the handlers' filters)."""
    files = log_files()
    for name in LIGHTNING:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            logger.removeHandler(handler)
        if logger.handlers and files:
            logger.propagate = False
            for handler in files:
                logger.addHandler(handler)
        for target in [logger, *logger.handlers]:
            for new in filters:
                if not any(type(f) is type(new) for f in target.filters):
                    target.addFilter(new)
