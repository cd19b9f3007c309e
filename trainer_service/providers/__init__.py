"""The built-in providers: name -> module, for the lazily importing registry.

Nothing here imports torch; each provider module is imported on first use by
``trainer_service.core.registry.ProviderRegistry``.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainer_service.core.registry import ProviderRegistry

__all__ = ["PROVIDER_MODULES", "ProviderRegistry", "default_registry"]

#: Built-in providers: name -> module path (a module with ``run`` and optionally ``validate``).
PROVIDER_MODULES: Mapping[str, str] = {
    "imitation": "trainer_service.providers.imitation",
    "grpo": "trainer_service.providers.grpo",
}


def default_registry() -> ProviderRegistry:
    """A registry of the built-in providers (nothing imported yet)."""
    return ProviderRegistry(PROVIDER_MODULES)
