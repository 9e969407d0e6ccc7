from __future__ import annotations

from django.apps import AppConfig


class OrgsConfig(AppConfig):
    name = "apps.orgs"
    label = "orgs"
    default_auto_field = "django.db.models.BigAutoField"
