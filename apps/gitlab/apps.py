from __future__ import annotations

from django.apps import AppConfig


class GitlabConfig(AppConfig):
    name = "apps.gitlab"
    label = "gitlab"
    verbose_name = "GitLab CI"
    default_auto_field = "django.db.models.BigAutoField"
