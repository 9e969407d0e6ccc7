from __future__ import annotations

from django.apps import AppConfig


class PoolsConfig(AppConfig):
    name = "apps.pools"
    label = "pools"
    default_auto_field = "django.db.models.BigAutoField"
