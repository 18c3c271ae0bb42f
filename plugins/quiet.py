"""Keep libraries' log lines and warnings off a command's output while they run (export, the ORT lowering).

They report what is no fault of the user's and needs nothing done (torch.onnx that torchvision is absent,
onnx_ir's initializer deduplication per If branch, torch.export's FutureWarnings). Our own failures are
errors, never warnings, so nothing of ours is hidden. Shared by export/ and engines/, hence here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def quiet_libraries(roots: Iterable[str]) -> Iterator[None]:
    """Within: the loggers named `roots`, and those below them that carry their own level (torch sets a
    few), log errors only, and no warning is shown; every level is put back on exit."""
    roots = tuple(roots)
    loggers = {logging.getLogger(name) for name, logger in logging.root.manager.loggerDict.items()
               if name.split(".")[0] in roots and isinstance(logger, logging.Logger) and logger.level}
    loggers |= {logging.getLogger(name) for name in roots}
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
