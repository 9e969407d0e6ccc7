from __future__ import annotations

from django.apps import AppConfig


class MachinesConfig(AppConfig):
    name = "apps.machines"
    label = "machines"
    default_auto_field = "django.db.models.BigAutoField"
