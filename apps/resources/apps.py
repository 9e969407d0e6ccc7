from __future__ import annotations

from django.apps import AppConfig


class ResourcesConfig(AppConfig):
    name = "apps.resources"
    label = "resources"
    default_auto_field = "django.db.models.BigAutoField"
