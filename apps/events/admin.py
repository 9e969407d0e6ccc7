from __future__ import annotations

from django.contrib import admin

from apps.core.admin import ReadOnlyAdmin
from apps.events.models import Event


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "kind", "org", "actor", "reason", "pool_id", "instance_id", "job_id")
    list_filter = ("kind", "org")
    search_fields = ("kind", "reason", "actor", "=pool_id", "=instance_id", "=job_id")
    date_hierarchy = "created_at"
    list_select_related = ("org",)
