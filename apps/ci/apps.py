from __future__ import annotations

from django.apps import AppConfig


class CiConfig(AppConfig):
    name = "apps.ci"
    label = "ci"
    verbose_name = "CI (what the forges share)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.ci import metrics  # noqa: F401 - registers the CI limits' metrics
