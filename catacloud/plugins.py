"""Drivers registered by dotted path and imported on first use (healthchecks' TRANSPORTS):
providers (catacloud.providers.DRIVERS) and resource wells (apps.resources.wells.WELLS)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping


class UnknownPlugin(LookupError):
    pass


@functools.cache
def _import(dotted: str) -> type:
    module_name, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def load_plugin(
    registry: Mapping[str, str],
    kind: str,
    base: type,
    what: str,
    *,
    unknown: type[Exception] = UnknownPlugin,
) -> type:
    """The class registered for ``kind``, checked to be a ``base``; ``unknown`` (the caller's own
    error, :class:`UnknownPlugin` by default) names the known kinds when ``kind`` is not one."""
    try:
        dotted = registry[kind]
    except KeyError:
        raise unknown(f"unknown {what} {kind!r}; known: {', '.join(sorted(registry))}") from None
    cls = _import(dotted)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{dotted} is not a {base.__name__}")
    return cls
