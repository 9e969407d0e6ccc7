from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from apps.core.admin import NoLiveDeleteAdmin, short_id_link
from apps.resources.choices import RESOURCE_LIVE
from apps.resources.models import ResourceInstance, ResourceType


@admin.register(ResourceType)
class ResourceTypeAdmin(admin.ModelAdmin):
    list_display = ("id", "well", "max_instances", "required_privilege", "description")
    list_filter = ("well", "required_privilege")
    search_fields = ("id", "description")


@admin.register(ResourceInstance)
class ResourceInstanceAdmin(NoLiveDeleteAdmin):
    """Created and destroyed by the wells: visible here, deleted only once destroyed or failed."""

    live_statuses = RESOURCE_LIVE
    list_display = (
        "short_id",
        "resource_type",
        "status",
        "org",
        "job_short",
        "external_id",
        "created_at",
        "destroyed_at",
    )
    list_filter = ("status", "resource_type", "org")
    search_fields = ("id", "external_id", "org__slug")
    # secret_encrypted is not editable and never shown.
    readonly_fields = [f.name for f in ResourceInstance._meta.fields if f.name != "secret_encrypted"]
    exclude = ("secret_encrypted",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: ResourceInstance) -> str:
        return short_id_link(obj.pk)

    @admin.display(description="job")
    def job_short(self, obj: ResourceInstance) -> str:
        return short_id_link(obj.job_id) if obj.job_id else "-"
