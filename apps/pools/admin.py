from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from apps.machines.models import MachineInstance
from apps.pools.models import InstancePool, PoolSchedule


class MemberInline(admin.TabularInline):
    model = MachineInstance
    fk_name = "pool"
    extra = 0
    can_delete = False
    fields = (
        "id",
        "status",
        "provider_id",
        "warming_started_at",
        "warmed_at",
        "claimed_at",
        "claimed_by",
        "outdated",
    )
    readonly_fields = fields
    show_change_link = True
    verbose_name = "member"

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class ScheduleInline(admin.TabularInline):
    model = PoolSchedule
    extra = 0


@admin.register(InstancePool)
class InstancePoolAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "org",
        "machine_type",
        "status",
        "target_size",
        "min_size",
        "max_size",
        "created_at",
    )
    list_filter = ("status", "org", "machine_type")
    search_fields = ("name", "description", "org__slug")
    readonly_fields = ("status", "created_at", "updated_at", "drained_at")
    inlines = [ScheduleInline, MemberInline]
