"""The package's logger (vLLM's ``init_logger``): one ``minivllm`` logger on stderr.

``MINIVLLM_LOGGING_LEVEL`` sets its level (default INFO). ``info_once`` says a
thing once per process, for facts about the machine that do not change
(which kernels were built, which path a dtype takes).
"""

from __future__ import annotations

import functools
import logging
import sys

from minivllm import envs

_ROOT = "minivllm"


@functools.lru_cache(maxsize=1)
def _root() -> logging.Logger:
    logger = logging.getLogger(_ROOT)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s minivllm: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(envs.MINIVLLM_LOGGING_LEVEL.upper())
        logger.propagate = False
    return logger


def init_logger(name: str) -> logging.Logger:
    _root()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


@functools.lru_cache(maxsize=None)
def info_once(message: str) -> None:
    init_logger(_ROOT).info(message)
