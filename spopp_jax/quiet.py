"""Third-party notices that are not actionable for a user of this package, removed at the
logger that emits them (one message each, matched exactly; every other warning still
shows).

- transformers logs "PyTorch was not found. Models won't be available and only
  tokenizers, configuration and file/data utilities can be used." when it is imported
  without torch. We use transformers only for tokenizers and chat templates, and our
  models are JAX, so for a JAX user who installed nothing wrong the notice is noise.
  It is an advisory logged once at import (transformers/__init__.py) on the library's
  root logger "transformers"; a `logging.Filter` on that logger, installed before the
  import, drops that one record. (Setting TRANSFORMERS_NO_ADVISORY_WARNINGS would hide
  every advisory transformers has, so it is not used.)

`install()` is idempotent and is called by `rollout_bridge/__init__.py`, the package
whose tokenizer code imports transformers on the default path.
"""

from __future__ import annotations

import logging

__all__ = ["DroppedNotice", "NOTICES", "install"]


class DroppedNotice(logging.Filter):
    """Drops records of one logger whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


# (logger name, message prefix)
NOTICES = (("transformers", "PyTorch was not found."),)


def install() -> None:
    """Adds the filters of NOTICES to their loggers (once)."""
    for logger_name, prefix in NOTICES:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, DroppedNotice) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(DroppedNotice(prefix))
