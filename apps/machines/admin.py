from __future__ import annotations

import json
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from apps.core.actors import Actor
from apps.core.admin import NoLiveDeleteAdmin, neutral_bool, run_service_action, short_id_link
from apps.core.errors import ValidationFailed
from apps.core.templatetags.console import between, fine_money, human_seconds
from apps.machines.api.serializers import MAX_DRAIN_SECONDS
from apps.machines.choices import INSTANCE_LIVE, HostStatus, InstanceStatus, ProviderKind
from apps.machines.costs import billing_of, instance_cost
from apps.machines.hostops import host_cordon, host_revoke, host_uncordon, host_update
from apps.machines.hosts import (
    MAX_TTL_SECONDS,
    clean_labels,
    enrolment_token_create,
    enrolment_token_revoke,
    hosts_usage,
)
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import EnrolmentToken, Host, MachineInstance, MachineType, ProviderAccount
from apps.machines.services import (
    machine_type_clean,
    machine_type_update,
    machine_type_upsert,
    provider_account_update,
    provider_account_upsert,
)
from catacloud.client.hosts import parse_duration


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

    def clean_name(self) -> str:
        """Names are unique per owner (the operator, or one organization's own accounts)."""
        name = self.cleaned_data["name"]
        same = ProviderAccount.objects.filter(name=name, org_id=self.instance.org_id).exclude(
            pk=self.instance.pk
        )
        if same.exists():
            raise forms.ValidationError(f"a provider account named {name} already exists")
        return name

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
    list_display = ("name", "kind", "org", "has_credentials", "created_at", "updated_at")
    list_filter = ("kind", ("org", admin.EmptyFieldListFilter))
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


class MachineTypeForm(forms.ModelForm):
    class Meta:
        model = MachineType
        fields = ("name", "provider_account", *MachineType.SETTABLE_FIELDS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A type stays with its owner: the operator's on the operator's accounts, an
        # organization's own on that organization's.
        if "provider_account" in self.fields:
            field = self.fields["provider_account"]
            field.queryset = ProviderAccount.objects.filter(org_id=self.instance.org_id)  # type: ignore[attr-defined]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        same = MachineType.objects.filter(name=name, org_id=self.instance.org_id).exclude(pk=self.instance.pk)
        if same.exists():
            raise forms.ValidationError(f"a machine type named {name} already exists")
        return name

    def clean(self) -> dict:
        """The service's rules (alternatives, labels, arch, sizes, network), checked before
        anything is written: a bad value is a message on the form, not an error page."""
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            machine_type_clean({k: v for k, v in data.items() if k not in ("name", "provider_account")})
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.detail) from None
        return data


@admin.register(MachineType)
class MachineTypeAdmin(admin.ModelAdmin):
    form = MachineTypeForm
    list_display = (
        "name",
        "provider_account",
        "org",
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


# ---- enrolled hosts and their enrolment tokens ---------------------------------------------------


class HostForm(forms.ModelForm):
    """What an operator changes on a host: its labels and monthly price (through host_update)."""

    class Meta:
        model = Host
        fields = ("labels", "monthly_price")

    def clean_labels(self) -> dict[str, str]:
        try:
            return clean_labels(self.cleaned_data.get("labels") or {})
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.detail) from None


class HostActionForm(helpers.ActionForm):
    drain_seconds = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=MAX_DRAIN_SECONDS,
        label="drain deadline (seconds)",
        help_text="for the drain action: jobs still running after this are requeued elsewhere",
    )


class HostChangeList(ChangeList):
    """The page's hosts, each with what its live slots take now (one grouped query)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        usage = hosts_usage(h.pk for h in self.result_list)
        for host in self.result_list:
            host.usage = usage.get(host.pk) or {}


def _used(host: Host) -> Mapping[str, Any]:
    used = getattr(host, "usage", None)
    return used if used is not None else hosts_usage([host.pk]).get(host.pk) or {}


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    """Machines users own, enrolled with a token: never bought, never deleted by the reconciler.
    Cordon, drain, uncordon and revoke go through the services (apps.machines.hostops)."""

    form = HostForm
    action_form = HostActionForm
    list_display = (
        "name",
        "short_id",
        "owner",
        "status",
        "label_list",
        "cpus_used",
        "memory_used",
        "slots",
        "scheduling",
        "seen",
    )
    list_filter = (
        "status",
        ("cordoned_at", admin.EmptyFieldListFilter),
        ("org", admin.RelatedOnlyFieldListFilter),
        "provider_account",
    )
    search_fields = ("name", "id", "org__slug", "agent_version")
    list_select_related = ("org", "provider_account")
    readonly_fields = (
        "name",
        "id",
        "owner",
        "provider_account",
        "status",
        "capacity",
        "usage_now",
        "scheduling",
        "cordoned_at",
        "drain_deadline",
        "arch",
        "agent_version",
        "enrolment",
        "enrolled_at",
        "last_seen_at",
        "status_changed_at",
    )
    fields = (*readonly_fields[:4], "labels", "monthly_price", *readonly_fields[4:])
    actions = ["cordon", "drain", "uncordon", "revoke"]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return HostChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # hosts enroll themselves, with a token (Enrolment tokens)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoke instead: its slots and their jobs are ended through the services

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Host) -> str:
        return short_id_link(obj.pk)

    @admin.display(description="org", ordering="org__slug")
    def owner(self, obj: Host) -> str:
        if obj.org is None:
            return format_html('<span title="{}">shared</span>', "any granted organization's jobs")
        return obj.org.slug

    @admin.display(description="labels")
    def label_list(self, obj: Host) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(obj.labels.items())) or "-"

    @admin.display(description="cpus used")
    def cpus_used(self, obj: Host) -> str:
        return f"{_used(obj).get('cpus') or 0} / {obj.cpus}"

    @admin.display(description="memory used (MB)")
    def memory_used(self, obj: Host) -> str:
        return f"{_used(obj).get('memory_mb') or 0} / {obj.memory_mb}"

    @admin.display(description="slots")
    def slots(self, obj: Host) -> int:
        return int(_used(obj).get("slots") or 0)

    @admin.display(description="capacity")
    def capacity(self, obj: Host) -> str:
        gpus = f", {obj.gpus} gpus" if obj.gpus else ""
        return f"{obj.cpus} cpus, {obj.memory_mb} MB memory, {obj.disk_gb} GB disk{gpus} ({obj.arch or '?'})"

    @admin.display(description="used now")
    def usage_now(self, obj: Host) -> str:
        used = _used(obj)
        return (
            f"{used.get('cpus') or 0} cpus, {used.get('memory_mb') or 0} MB memory, "
            f"{used.get('disk_gb') or 0} GB disk in {used.get('slots') or 0} slots"
        )

    @admin.display(description="scheduling", ordering="cordoned_at")
    def scheduling(self, obj: Host) -> str:
        if obj.status == HostStatus.REVOKED:
            return "-"
        if obj.drain_deadline is not None:
            when = timezone.localtime(obj.drain_deadline).strftime("%Y-%m-%d %H:%M:%S")
            return format_html('draining <span class="cc-muted">until {}</span>', when)
        return "cordoned" if obj.cordoned_at is not None else "schedulable"

    @admin.display(description="last seen", ordering="last_seen_at")
    def seen(self, obj: Host) -> str:
        if obj.last_seen_at is None:
            return "-"
        return format_html(
            '<span title="{}">{} ago</span>',
            timezone.localtime(obj.last_seen_at).strftime("%Y-%m-%d %H:%M:%S"),
            human_seconds(between(obj.last_seen_at, None)),
        )

    def save_model(self, request: HttpRequest, obj: Host, form: forms.ModelForm, change: bool) -> None:
        """Through ``host_update``: the event, and labels checked as the API checks them."""
        changed = {name: form.cleaned_data[name] for name in form.changed_data}
        if changed:
            saved = host_update(host_id=obj.pk, actor=Actor.admin(request.user.get_username()), **changed)
            obj.__dict__.update({k: v for k, v in saved.__dict__.items() if not k.startswith("_")})

    def _act(self, request: HttpRequest, queryset: Any, verb: str, fn: Any) -> None:
        actor = Actor.admin(request.user.get_username())
        run_service_action(self, request, queryset, verb, lambda h: fn(host_id=h.pk, actor=actor))

    @admin.action(description="Cordon selected hosts (no new job; running jobs finish)")
    def cordon(self, request: HttpRequest, queryset: Any) -> None:
        self._act(request, queryset, "cordoned", host_cordon)

    @admin.action(description="Drain selected hosts (cordon; requeue jobs still running after the deadline)")
    def drain(self, request: HttpRequest, queryset: Any) -> None:
        raw = request.POST.get("drain_seconds", "").strip()
        if not raw.isdigit() or int(raw) > MAX_DRAIN_SECONDS:
            self.message_user(
                request,
                "drain: give the deadline in seconds (0 to requeue their jobs at once) beside the action",
                messages.ERROR,
            )
            return
        seconds = int(raw)
        self._act(
            request,
            queryset,
            f"draining (jobs still running in {human_seconds(seconds)} are requeued)",
            lambda **kw: host_cordon(drain_seconds=seconds, **kw),
        )

    @admin.action(description="Uncordon selected hosts (jobs may run there again)")
    def uncordon(self, request: HttpRequest, queryset: Any) -> None:
        self._act(request, queryset, "uncordoned", host_uncordon)

    @admin.action(description="Revoke selected hosts (refuse their agents for good; requeue their jobs)")
    def revoke(self, request: HttpRequest, queryset: Any) -> None:
        self._act(request, queryset, "revoked", host_revoke)


class EnrolmentTokenForm(forms.ModelForm):
    ttl = forms.CharField(
        initial="24h", label="expires in", help_text="seconds, or 30m, 24h, 7d (at most a year)"
    )

    class Meta:
        model = EnrolmentToken
        fields = ("provider_account", "org", "labels", "max_uses", "description")
        help_texts = {
            "org": "only this organization's jobs run on its hosts; empty: shared by the operator (any "
            "organization granted a machine type on the account)",
            "labels": 'the labels its hosts get, e.g. {"gpu": "a4000", "site": "fsn1"}',
            "max_uses": "how many hosts may enroll with it",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "provider_account" in self.fields:
            self.fields["provider_account"].queryset = ProviderAccount.objects.filter(  # type: ignore[attr-defined]
                kind=ProviderKind.HOSTS
            )
            self.fields["provider_account"].help_text = "an account of kind hosts"
            self.fields["labels"].required = False

    def clean_labels(self) -> dict[str, str]:
        try:
            return clean_labels(self.cleaned_data.get("labels") or {})
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.detail) from None

    def clean_max_uses(self) -> int:
        value = self.cleaned_data["max_uses"]
        if not 1 <= value <= 10_000:
            raise forms.ValidationError("from 1 to 10000")
        return int(value)

    def clean_ttl(self) -> int:
        try:
            seconds = parse_duration(self.cleaned_data["ttl"], "expires in")
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None
        if not 60 <= seconds <= MAX_TTL_SECONDS:
            raise forms.ValidationError("from a minute to a year")
        return seconds


@admin.register(EnrolmentToken)
class EnrolmentTokenAdmin(admin.ModelAdmin):
    """What hosts enroll with: made here (shown once), revoked with the action; never edited."""

    form = EnrolmentTokenForm
    list_display = (
        "prefix",
        "owner",
        "provider_account",
        "label_list",
        "uses_of",
        "state",
        "expires_at",
        "created_by",
        "created_at",
    )
    list_filter = (("revoked_at", admin.EmptyFieldListFilter), ("org", admin.RelatedOnlyFieldListFilter))
    search_fields = ("prefix", "description", "org__slug")
    list_select_related = ("org", "provider_account")
    actions = ["revoke"]
    shown = ("prefix", "provider_account", "org", "labels", "uses", "max_uses", "expires_at", "state")
    more = ("revoked_at", "description", "created_by", "created_at")

    def get_fields(self, request: HttpRequest, obj: EnrolmentToken | None = None) -> Any:
        if obj is None:
            return ("provider_account", "org", "labels", "max_uses", "ttl", "description")
        return (*self.shown, *self.more)

    def get_readonly_fields(self, request: HttpRequest, obj: EnrolmentToken | None = None) -> Any:
        return (*self.shown, *self.more) if obj is not None else ()

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoke it: its hosts keep pointing at it

    @admin.display(description="org", ordering="org__slug")
    def owner(self, obj: EnrolmentToken) -> str:
        return obj.org.slug if obj.org is not None else "shared"

    @admin.display(description="labels")
    def label_list(self, obj: EnrolmentToken) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(obj.labels.items())) or "-"

    @admin.display(description="uses")
    def uses_of(self, obj: EnrolmentToken) -> str:
        return f"{obj.uses} / {obj.max_uses}"

    @admin.display(description="state")
    def state(self, obj: EnrolmentToken) -> str:
        if obj.revoked_at is not None:
            return "revoked"
        if obj.uses >= obj.max_uses:
            return "used up"
        return "expired" if obj.expires_at <= timezone.now() else "active"

    def save_model(
        self, request: HttpRequest, obj: EnrolmentToken, form: forms.ModelForm, change: bool
    ) -> None:
        if change:
            return
        data = form.cleaned_data
        token, secret = enrolment_token_create(
            provider_account=data["provider_account"],
            org=data.get("org"),
            labels=data.get("labels") or {},
            max_uses=data["max_uses"],
            ttl_seconds=data["ttl"],
            description=data.get("description") or "",
            actor=Actor.admin(request.user.get_username()),
        )
        obj.__dict__.update({k: v for k, v in token.__dict__.items() if not k.startswith("_")})
        obj._state.adding = False
        self.message_user(
            request,
            "New enrolment token (shown once, copy it now; on the host it is "
            f"CATACLOUD_ENROLMENT_TOKEN): {secret}",
            messages.WARNING,
        )

    @admin.action(description="Revoke selected tokens (no host enrolls with them; enrolled hosts stay)")
    def revoke(self, request: HttpRequest, queryset: Any) -> None:
        actor = Actor.admin(request.user.get_username())
        run_service_action(
            self, request, queryset, "revoked", lambda t: enrolment_token_revoke(token_id=t.pk, actor=actor)
        )
