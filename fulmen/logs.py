"""fulmen's logs, through the standard `logging` module.

Topics: `recompiles` (why each retrace happened), `passes` (seconds per pass), `breaks` (each
graph break, once, with its reason and line), `fusion` (fusion
decisions). Enable them with the environment variable `FULMEN_LOGS=recompiles,passes` (or `all`),
or with `logging.getLogger("fulmen.recompiles").setLevel(logging.INFO)` and a handler.
"""

from __future__ import annotations

import logging

from fulmen import config

TOPICS = ("recompiles", "passes", "fusion", "breaks")


def get_logger(topic: str) -> logging.Logger:
    """The logger of one topic (`fulmen.<topic>`)."""
    return logging.getLogger(f"fulmen.{topic}")


def configure_from_environment(value: str | None = None) -> list[str]:
    """Turn on the topics named in `FULMEN_LOGS` (INFO level, to stderr); return them."""
    value = config.get("FULMEN_LOGS") if value is None else value
    chosen = TOPICS if value.strip() == "all" else [t.strip() for t in value.split(",") if t.strip()]
    for topic in chosen:
        logger = get_logger(topic)
        logger.setLevel(logging.INFO)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            logger.addHandler(handler)
    return list(chosen)


configure_from_environment()
