from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from apps.resources.models import ResourceInstance, ResourceType


@admin.register(ResourceType)
class ResourceTypeAdmin(admin.ModelAdmin):
    list_display = ("id", "well", "max_instances", "required_privilege", "description")
    list_filter = ("well", "required_privilege")
    search_fields = ("id", "description")


@admin.register(ResourceInstance)
class ResourceInstanceAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "resource_type",
        "status",
        "org",
        "job",
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
