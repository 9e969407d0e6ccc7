from __future__ import annotations

from django import forms
from django.contrib import admin
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest

from apps.core.actors import Actor
from apps.core.admin import run_service_action, short_id_link
from apps.core.errors import DomainError
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance
from apps.machines.services import grant_for
from apps.pools.choices import PoolStatus
from apps.pools.models import InstancePool, PoolSchedule
from apps.pools.services import pool_create, pool_drain, pool_update, pool_validate_sizes


class MemberInline(admin.TabularInline):
    model = MachineInstance
    fk_name = "pool"
    extra = 0
    can_delete = False
    fields = (
        "short_id",
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

    @admin.display(description="id")
    def short_id(self, obj: MachineInstance) -> str:
        return short_id_link(obj.pk)


class ScheduleInline(admin.TabularInline):
    model = PoolSchedule
    extra = 0


class PoolForm(forms.ModelForm):
    """Checks sizes and the org's grant with the same service rules as the API."""

    class Meta:
        model = InstancePool
        fields = (
            "org",
            "name",
            "description",
            "machine_type",
            "target_size",
            "min_size",
            "max_size",
            "warmup_grace_seconds",
        )

    def clean(self) -> dict:
        data = super().clean() or {}
        org = data.get("org") or getattr(self.instance, "org", None)
        machine_type = data.get("machine_type") or getattr(self.instance, "machine_type", None)
        if org is None or machine_type is None:
            return data
        try:
            grant = grant_for(org=org, machine_type=machine_type)
            pool_validate_sizes(
                target_size=data.get("target_size", 0),
                min_size=data.get("min_size", 0),
                max_size=data.get("max_size", 0),
                max_pool_size=grant.max_pool_size,
            )
        except DomainError as exc:
            raise forms.ValidationError(exc.detail) from None
        return data


@admin.register(InstancePool)
class InstancePoolAdmin(admin.ModelAdmin):
    form = PoolForm
    list_display = (
        "name",
        "org",
        "machine_type",
        "status",
        "target_size",
        "min_size",
        "max_size",
        "ready_members",
        "limit_reason",
        "created_at",
    )
    list_filter = ("status", "org", "machine_type")
    search_fields = ("name", "description", "org__slug")
    readonly_fields = ("status", "limit_reason", "created_at", "updated_at", "drained_at")
    inlines = [ScheduleInline, MemberInline]
    actions = ["drain_terminate", "drain_release"]

    @admin.display(description="ready", ordering="n_ready")
    def ready_members(self, obj: InstancePool) -> int:
        return obj.n_ready  # type: ignore[attr-defined]  # annotated by get_queryset

    def get_queryset(self, request: HttpRequest) -> QuerySet[InstancePool]:
        ready = Count("members", filter=Q(members__status=InstanceStatus.READY))
        return super().get_queryset(request).select_related("org", "machine_type").annotate(n_ready=ready)

    def get_readonly_fields(self, request: HttpRequest, obj: InstancePool | None = None) -> tuple:
        if obj is not None:  # a pool's org and machine type never change
            return ("org", "machine_type", *self.readonly_fields)
        return self.readonly_fields

    def save_model(
        self, request: HttpRequest, obj: InstancePool, form: forms.ModelForm, change: bool
    ) -> None:
        """Through the services, so the console validates sizes and quotas like the API."""
        actor = Actor.admin(request.user.get_username())
        if change:
            fields = ("target_size", "min_size", "max_size", "warmup_grace_seconds", "description")
            pool_update(pool=obj, actor=actor, **{k: form.cleaned_data[k] for k in fields})
            return
        created = pool_create(
            org=obj.org,
            name=obj.name,
            machine_type=obj.machine_type,
            target_size=obj.target_size,
            min_size=obj.min_size,
            max_size=obj.max_size,
            warmup_grace_seconds=obj.warmup_grace_seconds,
            description=obj.description,
            actor=actor,
        )
        obj.pk = created.pk
        obj._state.adding = False

    def has_delete_permission(self, request: HttpRequest, obj: InstancePool | None = None) -> bool:
        return obj is None or obj.status == PoolStatus.DRAINED  # only a drained pool is deleted

    @admin.action(description="Drain selected pools and terminate their members")
    def drain_terminate(self, request: HttpRequest, queryset: QuerySet[InstancePool]) -> None:
        actor = Actor.admin(request.user.get_username())
        run_service_action(
            self,
            request,
            queryset,
            "drained (members terminated)",
            lambda p: pool_drain(pool=p, terminate_members=True, actor=actor),
        )

    @admin.action(description="Drain selected pools, releasing members as idle machines")
    def drain_release(self, request: HttpRequest, queryset: QuerySet[InstancePool]) -> None:
        actor = Actor.admin(request.user.get_username())
        run_service_action(
            self,
            request,
            queryset,
            "drained (members released)",
            lambda p: pool_drain(pool=p, terminate_members=False, actor=actor),
        )
