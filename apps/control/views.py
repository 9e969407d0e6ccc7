"""The console's live dashboard: /admin/dashboard/ (staff only).

The page renders the whole snapshot once; htmx (vendored by django-htmx, no build step)
then swaps in ``/admin/dashboard/panel/`` every few seconds. Without JavaScript a meta
refresh reloads the page instead.
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from apps.control.charts import minute_chart
from apps.control.dashboard import MEMBER_STATES, dashboard_snapshot

REFRESH_SECONDS = 5
STATE_COLOURS = {
    "ready": "#2e7d32",
    "claimed": "#1565c0",
    "warming": "#f9a825",
    "provisioning": "#ffb74d",
    "pending": "#bdbdbd",
    "terminating": "#8d6e63",
}


def _context(request: HttpRequest) -> dict:
    snap = dashboard_snapshot()
    series = snap["series"]
    minutes = series["minutes"]
    snap["throughput_svg"] = minute_chart(
        minutes,
        [
            ("succeeded", "#2e7d32", series["succeeded"]),
            ("failed", "#c62828", series["failed"]),
            ("cancelled", "#9e9e9e", series["cancelled"]),
        ],
        line=("submitted", "#1565c0", series["submitted"]),
        label="jobs finished per minute (bars) and submitted (line), last hour",
    )
    snap["wait_svg"] = minute_chart(
        minutes,
        [("mean wait", "#90caf9", series["wait_mean"])],
        line=("longest wait", "#e65100", series["wait_max"]),
        unit=" s",
        label="wait from queued to started, per minute of start, last hour",
    )
    snap["totals"] = {
        "finished": sum(series["succeeded"]) + sum(series["failed"]) + sum(series["cancelled"]),
        "succeeded": sum(series["succeeded"]),
        "failed": sum(series["failed"]),  # failed or timed out
        "cancelled": sum(series["cancelled"]),
        "submitted": sum(series["submitted"]),
    }
    snap["state_colours"] = [(s, STATE_COLOURS[s]) for s in MEMBER_STATES]
    snap["colour_of"] = STATE_COLOURS
    snap["refresh_seconds"] = REFRESH_SECONDS
    return snap


def dashboard_view(request: HttpRequest) -> TemplateResponse:
    context = {
        **admin.site.each_context(request),
        "title": "Live dashboard",
        "is_nav_sidebar_enabled": False,  # the whole width for the figures
        **_context(request),
    }
    return TemplateResponse(request, "admin/control/dashboard.html", context)


def dashboard_panel_view(request: HttpRequest) -> TemplateResponse:
    return TemplateResponse(request, "admin/control/dashboard_panel.html", _context(request))


def console_login(request: HttpRequest) -> HttpResponse:
    """The admin's login, landing on the live dashboard instead of the stock index (unless the
    operator was on the way to another page)."""
    wanted = request.POST.get(REDIRECT_FIELD_NAME) or request.GET.get(REDIRECT_FIELD_NAME)
    landing = None
    if not wanted or wanted == reverse("admin:index"):
        landing = {REDIRECT_FIELD_NAME: reverse("console-dashboard")}  # the form's hidden field
    return admin.site.login(request, extra_context=landing)


def console_urls() -> list:
    from django.urls import path

    return [
        path("", admin.site.admin_view(dashboard_view), name="console-dashboard"),
        path("panel/", admin.site.admin_view(dashboard_panel_view), name="console-dashboard-panel"),
    ]
