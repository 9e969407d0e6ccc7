from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest

from apps.core.actors import Actor
from apps.core.admin import run_service_action
from apps.orgs.models import ApiToken, Membership, Organization, Privilege
from apps.orgs.services import (
    api_token_create,
    api_token_revoke,
    membership_delete,
    membership_set,
    privilege_grant,
    privilege_revoke,
)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)


def membership_formset_save(request: HttpRequest, formset: BaseInlineFormSet) -> None:
    """Membership rows through ``membership_set`` / ``membership_delete`` (events, token revocation)."""
    actor = Actor.admin(request.user.get_username())
    formset.save(commit=False)  # fills new/changed/deleted objects; nothing is written here
    for membership in formset.deleted_objects:
        membership_delete(membership=membership, actor=actor)
    for membership, changed in formset.changed_objects:
        if "user" in changed:  # another user on this row: the old one leaves, the new one joins
            membership_delete(membership=Membership.objects.get(pk=membership.pk), actor=actor)
            formset.new_objects.append(membership)
        else:
            membership_set(org=membership.org, user=membership.user, role=membership.role, actor=actor)
    for membership in formset.new_objects:
        membership_set(org=membership.org, user=membership.user, role=membership.role, actor=actor)


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    """Grants and quotas join this page from the machines layer: apps/control/admin.py
    registers the full page (this app sits below machines and does not import it)."""

    list_display = ("slug", "name", "member_count", "created_at")
    search_fields = ("slug", "name")
    list_filter = ("privileges",)
    filter_horizontal = ("privileges",)
    inlines = [MembershipInline]

    @admin.display(description="members", ordering="n_members")
    def member_count(self, obj: Organization) -> int:
        return obj.n_members  # type: ignore[attr-defined]  # annotated by get_queryset

    def get_queryset(self, request: HttpRequest) -> QuerySet[Organization]:
        return super().get_queryset(request).annotate(n_members=Count("memberships"))

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Privileges through ``privilege_grant`` / ``privilege_revoke`` (events), then the inlines."""
        org = form.instance
        actor = Actor.admin(request.user.get_username())
        wanted = {p.name for p in form.cleaned_data.get("privileges", [])}
        current = set(org.privileges.values_list("name", flat=True))
        for name in sorted(wanted - current):
            privilege_grant(org=org, name=name, actor=actor)
        for name in sorted(current - wanted):
            privilege_revoke(org=org, name=name, actor=actor)
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)

    def save_formset(self, request: HttpRequest, form: Any, formset: BaseInlineFormSet, change: bool) -> None:
        if formset.model is Membership:
            membership_formset_save(request, formset)
        else:
            super().save_formset(request, form, formset, change)


@admin.register(Privilege)
class PrivilegeAdmin(admin.ModelAdmin):
    list_display = ("name", "description")
    search_fields = ("name", "description")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    """Saved through ``membership_set``, deleted through ``membership_delete``."""

    list_display = ("user", "org", "role", "created_at")
    list_filter = ("role", "org")
    search_fields = ("user__username", "org__slug")
    autocomplete_fields = ("user", "org")

    def get_readonly_fields(self, request: HttpRequest, obj: Membership | None = None) -> tuple:
        return ("org", "user") if obj is not None else ()  # change the role; remove and add otherwise

    def save_model(self, request: HttpRequest, obj: Membership, form: forms.ModelForm, change: bool) -> None:
        saved = membership_set(
            org=obj.org, user=obj.user, role=obj.role, actor=Actor.admin(request.user.get_username())
        )
        obj.pk = saved.pk
        obj._state.adding = False

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        membership_delete(membership=obj, actor=Actor.admin(request.user.get_username()))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Membership]) -> None:
        for membership in queryset.select_related("org", "user"):
            membership_delete(membership=membership, actor=Actor.admin(request.user.get_username()))


class ApiTokenForm(forms.ModelForm):
    class Meta:
        model = ApiToken
        fields = ("org", "user", "name", "role", "expires_at")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    form = ApiTokenForm
    list_display = (
        "prefix",
        "name",
        "user",
        "org",
        "role",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    list_filter = ("org", "role", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("prefix", "name", "user__username", "org__slug")
    readonly_fields = ("prefix", "created_at", "last_used_at", "revoked_at", "scope")
    actions = ["revoke"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> tuple:
        if obj is not None:  # a token's identity never changes; only revoke it
            return ("org", "user", "name", "role", "expires_at", *self.readonly_fields)
        return self.readonly_fields

    def save_model(self, request: HttpRequest, obj: ApiToken, form: forms.ModelForm, change: bool) -> None:
        if change:
            return
        token, secret = api_token_create(
            org=obj.org,
            user=obj.user,
            name=obj.name,
            role=obj.role,
            expires_at=obj.expires_at,
            actor=Actor.admin(request.user.get_username()),
        )
        obj.__dict__.update({k: v for k, v in token.__dict__.items() if not k.startswith("_")})
        self.message_user(request, f"New token (shown once, copy it now): {secret}", messages.WARNING)

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request: HttpRequest, queryset) -> None:
        run_service_action(
            self,
            request,
            queryset,
            "revoked",
            lambda t: api_token_revoke(token=t, actor=Actor.admin(request.user.get_username())),
        )
