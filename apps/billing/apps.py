from __future__ import annotations

from django.apps import AppConfig


class BillingConfig(AppConfig):
    """Money as the people who pay the bill see it: cost reports by job, configuration,
    repository and workflow, and budget administration. What buying a machine needs (a
    machine's cost, the budget gate) stays in ``apps.machines``, below every buyer."""

    name = "apps.billing"
    label = "billing"
    default_auto_field = "django.db.models.BigAutoField"
