from __future__ import annotations

from django.conf import settings

from apps.core.models import Installation

_cached: str | None = None


def installation_id() -> str:
    """The label value naming this installation's machines (setting, else the DB singleton)."""
    global _cached
    if settings.CATACLOUD_INSTALLATION:
        return str(settings.CATACLOUD_INSTALLATION)
    if _cached is None:
        _cached = str(Installation.objects.get_or_create(id=1)[0].installation_id)
    return _cached
