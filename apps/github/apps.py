from __future__ import annotations

from django.apps import AppConfig


class GithubConfig(AppConfig):
    name = "apps.github"
    label = "github"
    verbose_name = "GitHub Actions"
    default_auto_field = "django.db.models.BigAutoField"
