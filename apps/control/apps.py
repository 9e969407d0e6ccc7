from __future__ import annotations

from django.apps import AppConfig


class ControlConfig(AppConfig):
    """The top layer: it may import every app, and it wires the hooks of ``apps.core.hooks``."""

    name = "apps.control"
    label = "control"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.control import metrics  # noqa: F401 - registers the reaper's metrics
        from apps.control.wiring import connect_hooks

        connect_hooks()
