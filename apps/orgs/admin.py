from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest

from apps.core.admin import run_service_action
from apps.machines.models import OrgMachineType
from apps.orgs.models import ApiToken, Membership, Organization, Privilege
from apps.orgs.services import api_token_create, api_token_revoke


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)


class GrantInline(admin.TabularInline):
    model = OrgMachineType
    extra = 0
    fields = (
        "machine_type",
        "max_concurrent_jobs",
        "max_instances",
        "max_pool_size",
        "cpu_quota",
        "memory_quota_mb",
        "gpu_quota",
        "policy",
        "max_wait_seconds",
    )
    verbose_name = "machine type grant and quota"
    verbose_name_plural = "machine type grants and quotas"


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "member_count", "created_at")
    search_fields = ("slug", "name")
    list_filter = ("privileges",)
    filter_horizontal = ("privileges",)
    inlines = [MembershipInline, GrantInline]

    @admin.display(description="members")
    def member_count(self, obj: Organization) -> int:
        return obj.memberships.count()


@admin.register(Privilege)
class PrivilegeAdmin(admin.ModelAdmin):
    list_display = ("name", "description")
    search_fields = ("name", "description")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "org", "role", "created_at")
    list_filter = ("role", "org")
    search_fields = ("user__username", "org__slug")
    autocomplete_fields = ("user", "org")


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
            actor=f"admin:{request.user.get_username()}",
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
            lambda t: api_token_revoke(token=t, actor=f"admin:{request.user.get_username()}"),
        )
