"""Console pages that span layers: the organization page with its grants and quotas (in use
next to every limit), and the grant list. Registered here, in the top app, so that
``apps.orgs`` never imports ``apps.machines``. Every write goes through a service."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest
from django.utils.html import format_html_join

from apps.control.dashboard import grant_usage, grants_with_usage
from apps.control.services import grant_delete, grant_upsert, in_use_summary, org_in_use
from apps.core.actors import Actor
from apps.core.errors import DomainError
from apps.machines.models import OrgMachineType
from apps.machines.services import grant_check_privilege
from apps.orgs.admin import OrganizationAdmin as OrgsOrganizationAdmin
from apps.orgs.models import Organization

QUOTA_FIELDS = OrgMachineType.QUOTA_FIELDS


def usage_chips(grant: OrgMachineType) -> str:
    """``jobs 3/10 · machines 4/20 · …`` with a fill showing how full each limit is."""
    if grant.pk is None or not hasattr(grant, "used_jobs"):
        return "-"
    return format_html_join(
        "",
        '<span class="cc-quota{}"><i style="width:{}%"></i>{} {}/{}{}</span>',
        (
            (
                " cc-full" if u["limit"] is not None and u["used"] >= u["limit"] else "",
                f"{u['percent']:.0f}",
                u["name"],
                u["used"],
                "∞" if u["limit"] is None else u["limit"],
                u["unit"],
            )
            for u in grant_usage(grant)
        ),
    )


class GrantForm(forms.ModelForm):
    class Meta:
        model = OrgMachineType
        fields = ("org", "machine_type", *QUOTA_FIELDS)

    def clean(self) -> dict:
        data = super().clean() or {}
        org = data.get("org") or getattr(self.instance, "org", None)
        machine_type = data.get("machine_type")
        if self.instance.pk and machine_type and machine_type.pk != self.instance.machine_type_id:
            raise ValidationError("a grant's machine type cannot change: add a new grant and delete this one")
        if org is not None and machine_type is not None:
            try:
                grant_check_privilege(org=org, machine_type=machine_type)
            except DomainError as exc:
                raise ValidationError(exc.detail) from None
        return data


class GrantFormSet(BaseInlineFormSet):
    def clean(self) -> None:
        super().clean()
        for form in self.deleted_forms:
            grant = form.instance
            if grant.pk:
                used = in_use_summary(org_id=grant.org_id, machine_type_id=grant.machine_type_id)
                if used:
                    raise ValidationError(f"{grant} is still in use ({used}); it cannot be deleted")


class GrantInline(admin.TabularInline):
    model = OrgMachineType
    form = GrantForm
    formset = GrantFormSet
    extra = 0
    fields = ("machine_type", "in_use", *QUOTA_FIELDS)
    readonly_fields = ("in_use",)
    verbose_name = "machine type grant and quota"
    verbose_name_plural = "machine type grants and quotas (in use / limit)"

    def get_queryset(self, request: HttpRequest) -> QuerySet[OrgMachineType]:
        return grants_with_usage(super().get_queryset(request).select_related("machine_type"))

    @admin.display(description="in use / limit")
    def in_use(self, obj: OrgMachineType) -> str:
        return usage_chips(obj)


def _actor(request: HttpRequest) -> Actor:
    return Actor.admin(request.user.get_username())


def grant_formset_save(request: HttpRequest, formset: BaseInlineFormSet) -> None:
    formset.save(commit=False)  # nothing is written here: the services write below
    for grant in formset.deleted_objects:
        grant_delete(grant=grant, actor=_actor(request))
    for grant in [*formset.new_objects, *(obj for obj, _ in formset.changed_objects)]:
        grant_upsert(
            org=grant.org,
            machine_type=grant.machine_type,
            **{f: getattr(grant, f) for f in QUOTA_FIELDS},
        )


admin.site.unregister(Organization)


@admin.register(Organization)
class OrganizationAdmin(OrgsOrganizationAdmin):
    inlines = [*OrgsOrganizationAdmin.inlines, GrantInline]

    def save_formset(self, request: HttpRequest, form: Any, formset: BaseInlineFormSet, change: bool) -> None:
        if formset.model is OrgMachineType:
            grant_formset_save(request, formset)
        else:
            super().save_formset(request, form, formset, change)

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: Organization | None = None) -> bool:
        # An org with live machines, pools or jobs is not deleted from the console (its rows
        # would go with it and leave paid machines behind).
        if obj is not None and org_in_use(org=obj):
            return False
        return super().has_delete_permission(request, obj)


@admin.register(OrgMachineType)
class OrgMachineTypeAdmin(admin.ModelAdmin):
    """Grants with their usage; saved through ``grant_upsert``, deleted through ``grant_delete``."""

    form = GrantForm
    list_display = ("org", "machine_type", "in_use", "policy")
    list_filter = ("policy", "org", "machine_type")
    search_fields = ("org__slug", "machine_type__name")
    list_select_related = ("org", "machine_type")

    def get_queryset(self, request: HttpRequest) -> QuerySet[OrgMachineType]:
        return grants_with_usage(super().get_queryset(request))

    def get_readonly_fields(self, request: HttpRequest, obj: OrgMachineType | None = None) -> tuple:
        return ("org", "machine_type", "in_use") if obj is not None else ()

    @admin.display(description="in use / limit")
    def in_use(self, obj: OrgMachineType) -> str:
        return usage_chips(obj)

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: OrgMachineType | None = None) -> bool:
        if obj is not None and in_use_summary(org_id=obj.org_id, machine_type_id=obj.machine_type_id):
            return False
        return super().has_delete_permission(request, obj)

    def save_model(
        self, request: HttpRequest, obj: OrgMachineType, form: forms.ModelForm, change: bool
    ) -> None:
        saved, _ = grant_upsert(
            org=obj.org, machine_type=obj.machine_type, **{f: getattr(obj, f) for f in QUOTA_FIELDS}
        )
        obj.pk = saved.pk
        obj._state.adding = False

    def delete_model(self, request: HttpRequest, obj: OrgMachineType) -> None:
        try:
            grant_delete(grant=obj, actor=_actor(request))
        except DomainError as exc:
            self.message_user(request, exc.detail, messages.ERROR)
