from __future__ import annotations

from django.apps import AppConfig


class PoolsConfig(AppConfig):
    name = "apps.pools"
    label = "pools"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.pools import metrics  # noqa: F401 - registers the pool gauges
