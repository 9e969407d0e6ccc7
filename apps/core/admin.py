from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.http import HttpRequest
from django.utils.html import format_html

from apps.core.errors import DomainError
from apps.core.models import Heartbeat, Installation
from apps.core.templatetags.console import short_id_html

if TYPE_CHECKING:  # generic in the stubs only
    ModelAdmin = admin.ModelAdmin[Any]
else:
    ModelAdmin = admin.ModelAdmin


class ReadOnlyAdmin(ModelAdmin):
    """For append-only records: visible, never edited from the console."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class NoLiveDeleteAdmin(ModelAdmin):
    """Rows that something still drives (a live job, a live machine) cannot be deleted from
    the console: deleting one orphans what it holds (a paid machine, a quota slot). Use the
    model's actions (cancel, terminate), which go through the services; ended rows may be
    deleted one at a time. The bulk delete action is removed."""

    live_statuses: frozenset[str] = frozenset()

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.status in self.live_statuses:
            return False
        return super().has_delete_permission(request, obj)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions


def run_service_action(
    modeladmin: admin.ModelAdmin[Any],
    request: HttpRequest,
    queryset: Iterable[Any],
    verb: str,
    fn: Callable[[Any], object],
) -> None:
    """Call ``fn(obj)`` for each selected row; report successes and refusals to the operator."""
    done, refused = 0, []
    for obj in queryset:
        try:
            fn(obj)
            done += 1
        except DomainError as exc:
            refused.append(f"{obj}: {exc.detail}")
    if done:
        modeladmin.message_user(request, f"{verb}: {done}", messages.SUCCESS)
    for line in refused[:20]:
        modeladmin.message_user(request, line, messages.WARNING)


def short_id_link(value: object, url: str = "") -> str:
    """A UUID as its first 8 characters (the whole id in the tooltip), linked when ``url``."""
    html = short_id_html(value)
    return format_html('<a href="{}">{}</a>', url, html) if url else html


def neutral_bool(value: bool) -> str:
    """A yes/no column that is neither good nor bad: "yes" in bold, "no" greyed (Django's
    boolean icons paint every False as a red error)."""
    if value:
        return format_html('<span class="cc-yes">{}</span>', "yes")
    return format_html('<span class="cc-muted">{}</span>', "no")


@admin.register(Installation)
class InstallationAdmin(ReadOnlyAdmin):
    list_display = ("installation_id", "created_at")


@admin.register(Heartbeat)
class HeartbeatAdmin(ReadOnlyAdmin):
    list_display = ("name", "seen_at")
