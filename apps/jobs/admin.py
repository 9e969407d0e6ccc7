from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from apps.jobs.models import Job, JobConfiguration


@admin.register(JobConfiguration)
class JobConfigurationAdmin(admin.ModelAdmin):
    list_display = ("name", "org", "machine_type", "priority", "timeout_seconds", "max_attempts", "reuse")
    list_filter = ("org", "machine_type", "reuse")
    search_fields = ("name", "command", "org__slug")
    filter_horizontal = ("resource_types",)


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "status",
        "org",
        "config",
        "priority",
        "attempt",
        "pending_reason",
        "instance",
        "exit_code",
        "created_at",
        "started_at",
        "finished_at",
    )
    list_filter = ("status", "org", "machine_type", "config")
    search_fields = ("id", "config__name", "org__slug", "pending_reason")
    readonly_fields = [f.name for f in Job._meta.fields]
    date_hierarchy = "created_at"
    list_select_related = ("org", "config", "instance")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are submitted through the API
