"""GET /costs/ (the cost report) and /budgets/ (money budgets with their spend)."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.billing.budgets import budget_set
from apps.billing.costs import GROUPS, cost_report
from apps.core.api import StrictFields
from apps.core.errors import ErrorCode, ValidationFailed
from apps.machines.api.serializers import OrgMachineTypeField
from apps.machines.budgets import budget_spends, next_month, period_start
from apps.machines.models import Budget, BudgetPeriod, MachineInstance
from apps.orgs.api.base import OrgScopedViewSet

MAX_REPORT_DAYS = 400


def _parse_when(name: str, raw: str | None, default: datetime) -> datetime:
    if raw in (None, ""):
        return default
    value: datetime | None = None
    try:
        value = parse_datetime(raw)
        if value is None:
            day = parse_date(raw)
            value = datetime.combine(day, time.min) if day else None
    except (ValueError, OverflowError):
        value = None
    if value is None:
        raise ValidationFailed(
            f"{name}: expected a date (2026-11-01) or an ISO 8601 time",
            fields={name: ["expected a date (2026-11-01) or an ISO 8601 time"]},
        )
    return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)


COST_PARAMETERS = [
    OpenApiParameter("from", str, description="start (date or ISO time, UTC); default: this month's start"),
    OpenApiParameter(
        "to", str, description="end, exclusive (date or ISO time); default: the next month's start"
    ),
    OpenApiParameter("group_by", str, enum=list(GROUPS), description="default: day"),
]


class CostViewSet(OrgScopedViewSet):
    """What the org's machines cost in a window, split into job, warm, idle and tail parts."""

    queryset = MachineInstance.objects.none()

    @extend_schema(parameters=COST_PARAMETERS, responses={200: OpenApiTypes.OBJECT})
    def list(self, request: Request) -> Response:
        """Every cent of every machine, attributed: each job's share (the seconds it held the
        machine), warm (in a pool before a claim), idle (unheld otherwise) and tail (paid but
        unused end of the last period). A part counts in the window where it starts."""
        now = timezone.now()
        month = period_start("month", now)
        start = _parse_when("from", request.query_params.get("from"), month)
        # Default: the whole month (not "until now": a live machine's committed tail starts
        # now, and an end at now would leave it out; the same window gives the same money).
        end = _parse_when("to", request.query_params.get("to"), next_month(month))
        group_by = request.query_params.get("group_by") or "day"
        if group_by not in GROUPS:
            raise ValidationFailed(
                f"group_by: must be one of {', '.join(GROUPS)}",
                fields={"group_by": [f"must be one of {', '.join(GROUPS)}"]},
            )
        if end <= start or end - start > timedelta(days=MAX_REPORT_DAYS):
            raise ValidationFailed(
                f"to must be after from, at most {MAX_REPORT_DAYS} days later",
                fields={"to": [f"must be after from, at most {MAX_REPORT_DAYS} days later"]},
                code=ErrorCode.INVALID_RANGE,
            )
        return Response(cost_report(org=self.ctx.org, start=start, end=end, group_by=group_by, now=now))


class BudgetSerializer(StrictFields, serializers.ModelSerializer):
    machine_type = OrgMachineTypeField(represent="name", required=False, allow_null=True)
    period = serializers.ChoiceField(choices=BudgetPeriod.choices, default=BudgetPeriod.MONTH)
    amount = serializers.DecimalField(max_digits=14, decimal_places=2, min_value=Decimal(0))
    currency = serializers.SerializerMethodField()
    spend = serializers.SerializerMethodField(help_text="spent + committed in the current period")

    class Meta:
        model = Budget
        fields = (
            "id",
            "machine_type",
            "period",
            "amount",
            "currency",
            "spend",
            "alerted_level",
            "updated_at",
        )
        read_only_fields = ("id", "currency", "spend", "alerted_level", "updated_at")

    def get_currency(self, obj: Budget) -> str:
        return settings.CATACLOUD_CURRENCY

    def get_spend(self, obj: Budget) -> str:
        spends = self.context.get("spends") or budget_spends([obj], now=timezone.now())
        return str(spends[obj.pk].quantize(Decimal("0.01")))


class BudgetViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Money budgets: viewers read them with their spend; admins set them (POST upserts by
    machine type and period; the next scheduler tick or refill counts the new amount)."""

    queryset = Budget.objects.select_related("machine_type")
    serializer_class = BudgetSerializer
    ordering = ("period",)

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        budgets = list(page if page is not None else self.filter_queryset(self.get_queryset()))
        context = {**self.get_serializer_context(), "spends": budget_spends(budgets, now=timezone.now())}
        data = BudgetSerializer(budgets, many=True, context=context).data
        return self.get_paginated_response(data) if page is not None else Response(data)

    @extend_schema(request=BudgetSerializer, responses={201: BudgetSerializer})
    def create(self, request: Request) -> Response:
        body = BudgetSerializer(data=request.data, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        budget = budget_set(
            org=self.ctx.org,
            amount=body.validated_data["amount"],
            period=body.validated_data.get("period", BudgetPeriod.MONTH),
            machine_type=body.validated_data.get("machine_type"),
            actor=self.actor(),
        )
        return Response(BudgetSerializer(budget).data, status=status.HTTP_201_CREATED)
