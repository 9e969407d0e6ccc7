from __future__ import annotations

from django.contrib import admin

from apps.core.admin import ReadOnlyAdmin, short_id_link
from apps.events.models import Event


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "kind", "org", "actor", "reason", "pool", "instance", "job")
    list_filter = ("kind", "org")
    search_fields = ("kind", "reason", "actor", "=pool_id", "=instance_id", "=job_id")
    date_hierarchy = "created_at"
    list_select_related = ("org",)

    @admin.display(description="pool")
    def pool(self, obj: Event) -> str:
        return short_id_link(obj.pool_id) if obj.pool_id else "-"

    @admin.display(description="instance")
    def instance(self, obj: Event) -> str:
        return short_id_link(obj.instance_id) if obj.instance_id else "-"

    @admin.display(description="job")
    def job(self, obj: Event) -> str:
        return short_id_link(obj.job_id) if obj.job_id else "-"
