from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html_join

from apps.core.admin import NoLiveDeleteAdmin, run_service_action
from apps.events.models import Event
from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job, JobConfiguration
from apps.jobs.submission import job_cancel


@admin.register(JobConfiguration)
class JobConfigurationAdmin(admin.ModelAdmin):
    list_display = ("name", "org", "machine_type", "priority", "timeout_seconds", "max_attempts", "reuse")
    list_filter = ("org", "machine_type", "reuse")
    search_fields = ("name", "command", "org__slug")
    filter_horizontal = ("resource_types",)


@admin.register(Job)
class JobAdmin(NoLiveDeleteAdmin):
    live_statuses = JOB_LIVE
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
    readonly_fields = [*(f.name for f in Job._meta.fields), "event_log"]
    date_hierarchy = "created_at"
    list_select_related = ("org", "config", "instance")

    actions = ["cancel"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are submitted through the API

    @admin.display(description="events")
    def event_log(self, obj: Job) -> str:
        rows = Event.objects.filter(job_id=obj.pk).order_by("id")[:200]
        return (
            format_html_join(
                "\n",
                "<div>{} &nbsp; <b>{}</b> &nbsp; {} {}</div>",
                ((e.created_at.strftime("%Y-%m-%d %H:%M:%S"), e.kind, e.actor, e.reason) for e in rows),
            )
            or "-"
        )

    @admin.action(description="Cancel selected jobs")
    def cancel(self, request: HttpRequest, queryset) -> None:
        actor = f"admin:{request.user.get_username()}"
        run_service_action(
            self, request, queryset, "cancelled or cancel requested", lambda j: job_cancel(job=j, actor=actor)
        )
