"""The console's money pages: budgets (saved through ``budget_set``) and the cost-per-day chart
at /admin/machines/budget/costs/ (the Budget model keeps its machines label and its table)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from html import escape

from django import forms
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from apps.billing.budgets import budget_set
from apps.billing.costs import cost_report
from apps.core.actors import Actor
from apps.core.templatetags.console import fine_money
from apps.machines.budgets import budget_spend
from apps.machines.models import Budget
from apps.orgs.models import Organization


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    """Money budgets; saving goes through ``budget_set`` (events, thresholds announced anew)."""

    list_display = ("org", "machine_type", "period", "amount", "spend_now", "alerted_level")
    list_filter = ("period", "org")
    fields = ("org", "machine_type", "period", "amount")
    change_list_template = "admin/billing/budget_change_list.html"

    def get_urls(self) -> list:
        chart = path("costs/", self.admin_site.admin_view(cost_chart_view), name="billing_cost_chart")
        return [chart, *super().get_urls()]

    @admin.display(description="spent + committed now")
    def spend_now(self, obj: Budget) -> str:
        return f"{budget_spend(obj, now=timezone.now()):.2f} {settings.CATACLOUD_CURRENCY}"

    def save_model(self, request: HttpRequest, obj: Budget, form: forms.ModelForm, change: bool) -> None:
        if change:  # the scope or period may change too: keep this row, then record it as set
            Budget.objects.filter(pk=obj.pk).update(
                org=obj.org, machine_type=obj.machine_type, period=obj.period
            )
        saved = budget_set(
            org=obj.org,
            amount=obj.amount,
            period=obj.period,
            machine_type=obj.machine_type,
            actor=Actor.admin(request.user.get_username()),
        )
        obj.pk = saved.pk


# ---- cost chart: /admin/machines/budget/costs/ -------------------------------------------------

CHART_COLOURS = {"job": "#2e7d32", "warm": "#f9a825", "idle": "#ef6c00", "tail": "#9e9e9e"}


def cost_chart_svg(days: list[tuple[str, dict[str, Decimal]]], *, width: int = 900, height: int = 220) -> str:
    """Stacked bars (job, warm, idle, tail) per day, as inline SVG (no scripts)."""
    top = max((sum(kinds.values(), Decimal(0)) for _, kinds in days), default=Decimal(0)) or Decimal(1)
    bar = max(2, (width - 40) // max(1, len(days)))
    parts = [f'<svg width="{width}" height="{height + 30}" role="img" xmlns="http://www.w3.org/2000/svg">']
    for i, (day, kinds) in enumerate(days):
        x, y = 40 + i * bar, float(height)
        title = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items())
        for kind in ("job", "warm", "idle", "tail"):
            h = float(kinds.get(kind, 0) / top) * height
            if h <= 0:
                continue
            y -= h
            parts.append(
                f'<rect x="{x}" y="{y:.1f}" width="{bar - 1}" height="{h:.1f}" fill="{CHART_COLOURS[kind]}">'
                f"<title>{escape(day)}: {escape(title)}</title></rect>"
            )
        if len(days) <= 31 or i % 7 == 0:
            parts.append(f'<text x="{x}" y="{height + 14}" font-size="9">{escape(day[5:])}</text>')
    parts.append(f'<text x="0" y="10" font-size="10">{top:.2f}</text></svg>')
    return "".join(parts)


def cost_chart_view(request: HttpRequest) -> TemplateResponse:
    try:
        days = min(400, max(1, int(request.GET.get("days", "30"))))
    except ValueError:
        days = 30
    now = timezone.now()
    start = (now - timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    charts = []
    for org in Organization.objects.order_by("slug"):
        report = cost_report(org=org, start=start, end=now, group_by="day", now=now)
        if Decimal(report["total"]) == 0:
            continue
        rows = [(r["key"], {k: Decimal(r[k]) for k in CHART_COLOURS}) for r in report["results"]]
        charts.append(
            {
                "org": org.slug,
                "total": f"{Decimal(report['total']):.2f}",
                "shares": {k: f"{v:.1%}" for k, v in report["shares"].items()},
                "amounts": {k: fine_money(v) for k, v in report["by_kind"].items()},
                "svg": cost_chart_svg(rows),
            }
        )
    context = {
        **admin.site.each_context(request),
        "charts": charts,
        "days": days,
        "currency": settings.CATACLOUD_CURRENCY,
        "title": "Cost per day",
    }
    return TemplateResponse(request, "admin/billing/cost_chart.html", context)
