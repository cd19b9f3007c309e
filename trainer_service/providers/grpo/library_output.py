"""Keeps the ML libraries' own output inside the trainer's logging, in the trainer and its workers.

transformers and datasets attach their own stderr handlers to their library loggers, and
transformers, datasets and huggingface_hub draw tqdm progress bars on stderr; Python warnings
(``warnings.warn``, used by torch, transformers, TRL and PIL) print straight to stderr too.
With ``--log-format json`` each of those breaks the one-JSON-object-per-line promise.

:func:`route_library_output` turns the progress bars off, removes the libraries' handlers so
their records propagate to the root logger (and its formatter), and captures warnings into the
``py.warnings`` logger. DataLoader workers are separate processes (one started from a fork
server inherits none of this): :class:`WorkerLogging` is a picklable ``worker_init_fn`` wrapper
that gives each worker the parent's root formatter and level and routes its output the same way.

Importing this module is cheap: the libraries are touched only if already imported.
"""

from __future__ import annotations

import logging
import pickle
import sys
from collections.abc import Callable
from typing import Any

# Library root loggers that install a handler of their own.
_LIBRARY_LOGGERS = ("transformers", "datasets", "huggingface_hub")


def route_library_output() -> None:
    """Progress bars off, library records to the root logger, warnings to ``py.warnings``.

    Idempotent; only touches the libraries that are already imported.
    """
    logging.captureWarnings(True)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.utils.logging.enable_propagation()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        for handler in list(library.handlers):
            library.removeHandler(handler)
        library.propagate = True


class WorkerLogging:
    """A ``worker_init_fn`` that sets a DataLoader worker's logging up like its parent's.

    Args:
        wrapped: The ``worker_init_fn`` to call afterwards (``None``: none).
        formatter: The parent's root formatter (``None``: plain ``logging.Formatter``).
        level: The parent's root level.
    """

    def __init__(
        self,
        wrapped: Callable[[int], Any] | None,
        formatter: logging.Formatter | None,
        level: int,
    ) -> None:
        self.wrapped = wrapped
        self.formatter = formatter
        self.level = level

    @classmethod
    def like_this_process(cls, wrapped: Callable[[int], Any] | None) -> WorkerLogging:
        """Captures this process's root formatter (of its first handler) and level.

        A formatter that does not pickle (one holding a terminal, as pytest's does) travels as
        a plain ``logging.Formatter`` with the same format strings.
        """
        root = logging.getLogger()
        formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
        if formatter is not None:
            try:
                pickle.dumps(formatter)
            except (pickle.PicklingError, TypeError, AttributeError):
                formatter = logging.Formatter(formatter._fmt, formatter.datefmt)
        return cls(wrapped, formatter, root.level)

    def __call__(self, worker_id: int) -> None:
        handler = logging.StreamHandler(sys.stderr)
        if self.formatter is not None:
            handler.setFormatter(self.formatter)
        root = logging.getLogger()
        for old in list(root.handlers):
            root.removeHandler(old)
        root.addHandler(handler)
        root.setLevel(self.level)
        route_library_output()
        if self.wrapped is not None:
            self.wrapped(worker_id)
