from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from apps.core.actors import Actor
from apps.core.admin import NoLiveDeleteAdmin, neutral_bool, run_service_action, short_id_link
from apps.core.templatetags.console import between, fine_money, human_seconds
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.costs import billing_of, instance_cost
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.machines.services import (
    machine_type_update,
    machine_type_upsert,
    provider_account_update,
    provider_account_upsert,
)


class ProviderAccountForm(forms.ModelForm):
    new_credentials = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text='JSON, e.g. {"token": "..."}; write-only: leave empty to keep the stored credentials. '
        "Prefer `manage.py apply` with env/file references.",
    )

    class Meta:
        model = ProviderAccount
        fields = ("name", "kind", "config")

    def clean_new_credentials(self) -> dict | None:
        raw = self.cleaned_data.get("new_credentials")
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            raise forms.ValidationError("must be a JSON object") from None
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise forms.ValidationError("must be a JSON object of strings")
        return value


@admin.register(ProviderAccount)
class ProviderAccountAdmin(admin.ModelAdmin):
    form = ProviderAccountForm
    list_display = ("name", "kind", "has_credentials", "created_at", "updated_at")
    list_filter = ("kind",)
    search_fields = ("name",)

    @admin.display(description="credentials set")
    def has_credentials(self, obj: ProviderAccount) -> str:
        return neutral_bool(bool(obj.credentials_encrypted))  # a local account needs none

    def get_readonly_fields(self, request: HttpRequest, obj: ProviderAccount | None = None) -> tuple:
        return ("kind",) if obj is not None else ()  # a provider account's kind never changes

    def save_model(
        self, request: HttpRequest, obj: ProviderAccount, form: forms.ModelForm, change: bool
    ) -> None:
        """Through the services: a rename changes this row (its machines keep pointing at it),
        never creates a second account."""
        credentials = form.cleaned_data.get("new_credentials")
        actor = Actor.admin(request.user.get_username())
        if change:
            account, _ = provider_account_update(
                account=obj, name=obj.name, config=obj.config, credentials=credentials, actor=actor
            )
        else:
            account, _ = provider_account_upsert(
                name=obj.name, kind=obj.kind, config=obj.config, credentials=credentials
            )
        obj.__dict__.update({k: v for k, v in account.__dict__.items() if not k.startswith("_")})
        obj._state.adding = False


@admin.register(MachineType)
class MachineTypeAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "provider_account",
        "server_type",
        "location",
        "cpus",
        "memory_mb",
        "gpus",
        "spot",
        "price_per_hour",
        "billing_increment_seconds",
        "version",
    )
    list_filter = ("provider_account", "spot", "required_privilege")
    search_fields = ("name", "server_type", "image", "description")
    fields = ("name", "provider_account", *MachineType.SETTABLE_FIELDS, "version", "created_at", "updated_at")
    readonly_fields = ("version", "created_at", "updated_at")

    def save_model(self, request: HttpRequest, obj: MachineType, form: forms.ModelForm, change: bool) -> None:
        """Through ``machine_type_update`` / ``machine_type_upsert``: the version bump (pool
        drift) and the event live in the service, not here."""
        fields = {k: v for k, v in form.cleaned_data.items() if k not in ("name", "provider_account")}
        if change:
            saved, _ = machine_type_update(
                machine_type=obj,
                actor=Actor.admin(request.user.get_username()),
                name=obj.name,
                provider_account=obj.provider_account,
                **fields,
            )
        else:
            fields.pop("required_privilege", None)
            saved, _ = machine_type_upsert(
                name=obj.name,
                provider_account=obj.provider_account,
                required_privilege=obj.required_privilege,
                **fields,
            )
        obj.__dict__.update({k: v for k, v in saved.__dict__.items() if not k.startswith("_")})
        obj._state.adding = False


class InstanceStatusFilter(admin.SimpleListFilter):
    """The status filter, showing every machine but the terminated ones unless asked: those pile
    up (one per job on a fleet that does not reuse) and hide the few an operator looks for. A
    search (by id, provider id, …) looks at every machine."""

    title = "status"
    parameter_name = "status"
    ALL = "all"
    LIVE = "live"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            (self.LIVE, "live"),
            *((s.value, s.value) for s in InstanceStatus),
            (self.ALL, "all, terminated too"),
        ]

    def choices(self, changelist: Any) -> Any:
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": "not terminated",
        }
        for lookup, title in self.lookup_choices:
            yield {
                "selected": self.value() == lookup,
                "query_string": changelist.get_query_string({self.parameter_name: lookup}),
                "display": title,
            }

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        value = self.value()
        if value is None:
            return queryset if request.GET.get("q") else queryset.exclude(status=InstanceStatus.TERMINATED)
        if value == self.LIVE:
            return queryset.filter(status__in=INSTANCE_LIVE)
        if value in InstanceStatus.values:
            return queryset.filter(status=value)
        return queryset  # all


@admin.register(MachineInstance)
class MachineInstanceAdmin(NoLiveDeleteAdmin):
    live_statuses = INSTANCE_LIVE
    list_display = (
        "short_id",
        "status_flag",
        "org_pool",
        "machine_type",
        "provider_short",
        "age",
        "heartbeat",
        "billed",
    )
    list_filter = (
        InstanceStatusFilter,
        "provider_account__kind",
        "provider_account",
        "machine_type",
        "pool",
        "outdated",
    )
    search_fields = ("id", "provider_id", "claimed_by", "claimed_for", "org__slug")
    readonly_fields = [
        "cost_summary",
        *(
            f.name
            for f in MachineInstance._meta.fields
            if f.name not in ("bootstrap_token_hash", "agent_token_hash")
        ),
    ]
    exclude = ("bootstrap_token_hash", "agent_token_hash")
    date_hierarchy = "created_at"
    list_select_related = ("org", "machine_type", "pool", "provider_account")

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: MachineInstance) -> str:
        return short_id_link(obj.pk)

    @admin.display(description="provider id", ordering="provider_id")
    def provider_short(self, obj: MachineInstance) -> str:
        """The provider's id without repeating ours: ``cc-<uuid>`` (Hetzner's server name, the
        local provider's) as ``cc-0f3b5f2e…``; the whole id in the tooltip."""
        value = obj.provider_id or ""
        shown = value.replace(str(obj.pk), f"{str(obj.pk)[:8]}…") if value else "-"
        if len(shown) > 20:
            shown = f"{shown[:19]}…"
        return format_html('<span title="{}">{}</span>', value, shown)

    @admin.display(description="org / pool", ordering="org__slug")
    def org_pool(self, obj: MachineInstance) -> str:
        return f"{obj.org.slug}/{obj.pool.name}" if obj.pool is not None else obj.org.slug

    @admin.display(description="status", ordering="status")
    def status_flag(self, obj: MachineInstance) -> str:
        """The state, and "outdated" (built from an older machine type version) only when it is."""
        if obj.outdated:
            return format_html(
                '{} <span class="cc-muted" title="built from an older machine type">outdated</span>',
                obj.status,
            )
        return obj.status

    @admin.display(description="age", ordering="created_at")
    def age(self, obj: MachineInstance) -> str:
        return format_html(
            '<span title="created {}">{}</span>',
            timezone.localtime(obj.created_at).strftime("%Y-%m-%d %H:%M:%S"),
            human_seconds(between(obj.created_at, obj.ended_at)),
        )

    @admin.display(description="heartbeat", ordering="last_heartbeat_at")
    def heartbeat(self, obj: MachineInstance) -> str:
        if obj.last_heartbeat_at is None:
            return "-"
        return format_html(
            '<span title="{}">{} ago</span>',
            timezone.localtime(obj.last_heartbeat_at).strftime("%Y-%m-%d %H:%M:%S"),
            human_seconds(between(obj.last_heartbeat_at, None)),
        )

    @admin.display(description="billed", ordering="cost")
    def billed(self, obj: MachineInstance) -> str:
        """Ended: the recorded cost. Live: what it has committed (to the end of its current
        paid period). Never at the provider: nothing. In CATACLOUD_CURRENCY (the tooltip)."""
        if obj.cost is not None:
            return format_html(
                '<span title="billed, {}">{}</span>', settings.CATACLOUD_CURRENCY, fine_money(obj.cost)
            )
        if obj.provisioning_started_at is None:
            return "-"
        committed = billing_of(obj.machine_type).cost(between(obj.provisioning_started_at, obj.ended_at) or 0)
        return format_html(
            '<span title="committed so far (live), {}">{}…</span>',
            settings.CATACLOUD_CURRENCY,
            fine_money(committed),
        )

    @admin.display(description="cost")
    def cost_summary(self, obj: MachineInstance) -> str:
        summary = instance_cost(obj, now=timezone.now())
        parts = ", ".join(f"{k} {fine_money(v)}" for k, v in summary["by_kind"].items() if Decimal(v))
        return format_html(
            "{} {} {} ({} billed seconds){}",
            fine_money(summary["cost"]),
            settings.CATACLOUD_CURRENCY,
            "committed so far" if summary["live"] else "billed",
            summary["billed_seconds"],
            f": {parts}" if parts else "",
        )

    actions = ["terminate"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # machines are created by pools and jobs, never by hand

    @admin.action(description="Terminate selected instances (destroy the machines)")
    def terminate(self, request: HttpRequest, queryset) -> None:
        actor = Actor.admin(request.user.get_username())
        run_service_action(
            self,
            request,
            queryset,
            "terminating",
            lambda i: instance_terminate(instance_id=i.pk, actor=actor, reason="terminated from the console"),
        )
