"""The provider registry: provider name -> provider module, each imported on first use.

Providers import torch (and, for GRPO, trl/transformers), so the registry imports a provider's
module only when a job or ``GetCapabilities`` first asks for it. A provider whose module fails to
import is left out of the offered providers with a logged warning; the others keep working.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping
from types import ModuleType

_LOGGER = logging.getLogger(__name__)


class ProviderRegistry:
    """Maps provider names to provider modules, importing each on first use.

    Args:
        modules: name -> module path, or name -> an already imported module / object with
            ``run`` (tests register fakes this way).
    """

    def __init__(self, modules: Mapping[str, str | object]) -> None:
        self._specs: dict[str, str | object] = dict(modules)
        self._loaded: dict[str, object] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> object | None:
        """Returns the provider module for ``name``, or ``None`` if unknown or unimportable."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            if name in self._failed or name not in self._specs:
                return None
            spec = self._specs[name]
            if not isinstance(spec, str):
                self._loaded[name] = spec
                return spec
            try:
                module: ModuleType = importlib.import_module(spec)
            except Exception as exc:  # any import failure just drops the provider
                self._failed[name] = f"{type(exc).__name__}: {exc}"
                _LOGGER.warning("provider %r unavailable: cannot import %s: %s", name, spec, exc)
                return None
            if not callable(getattr(module, "run", None)):
                self._failed[name] = "no run()"
                _LOGGER.warning("provider %r unavailable: %s has no run()", name, spec)
                return None
            self._loaded[name] = module
            return module

    def unavailable_reason(self, name: str) -> str:
        """Why ``get(name)`` returned ``None`` (empty when it did not)."""
        if self.get(name) is not None:
            return ""
        with self._lock:
            return self._failed.get(name, "not registered")

    def available(self) -> list[str]:
        """Names of the providers that import, in registration order (imports them all)."""
        return [name for name in self._specs if self.get(name) is not None]

    def known(self) -> list[str]:
        """Every registered name, importable or not."""
        return list(self._specs)
