from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import django_filters
from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.api import StrictFields
from apps.core.errors import ErrorCode, ValidationFailed
from apps.machines.api.serializers import InstanceSerializer, MachineTypeSerializer, OrgMachineTypeField
from apps.machines.budgets import budget_set, budget_spends, next_month, period_start
from apps.machines.choices import InstanceStatus
from apps.machines.costs import GROUPS, cost_report, instance_cost
from apps.machines.lifecycle import instance_release_claim, instance_terminate
from apps.machines.models import Budget, BudgetPeriod, MachineInstance, MachineType
from apps.machines.selectors import machine_types_for_org
from apps.orgs.api.base import IdPrefixFilter, OrgScopedFilterSet, OrgScopedViewSet


class MachineTypeFilter(OrgScopedFilterSet):
    provider = django_filters.CharFilter(field_name="provider_account__kind")

    class Meta:
        model = MachineType
        fields = {"name": ["exact"], "spot": ["exact"], "gpus": ["gte"], "cpus": ["gte"]}


class MachineTypeViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Machine types the organization may use, with its quota on each."""

    queryset = MachineType.objects.all()
    serializer_class = MachineTypeSerializer
    filterset_class = MachineTypeFilter
    ordering_fields = ("name", "cpus", "memory_mb", "price_per_hour")
    ordering = ("name",)

    def get_queryset(self) -> QuerySet[MachineType]:
        if getattr(self, "swagger_fake_view", False):
            return MachineType.objects.none()
        return machine_types_for_org(org=self.ctx.org)

    needs_privileges = True


class InstanceFilter(OrgScopedFilterSet):
    status = django_filters.MultipleChoiceFilter(choices=InstanceStatus.choices)
    provider = django_filters.CharFilter(field_name="provider_account__kind")
    machine_type = django_filters.CharFilter(field_name="machine_type__name")
    pool = django_filters.UUIDFilter(field_name="pool_id")
    id_prefix = IdPrefixFilter()

    class Meta:
        model = MachineInstance
        fields = ("status", "provider", "machine_type", "pool", "outdated")


class TerminateOut(serializers.Serializer):
    id = serializers.UUIDField()
    status = serializers.CharField()


class ReleaseIn(StrictFields):
    claim_id = serializers.UUIDField(
        required=False, allow_null=True, help_text="if given, only this claim is released"
    )


class InstanceViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The org's machine instances: status, pool, provider ids, timestamps, cost."""

    queryset = MachineInstance.objects.select_related("machine_type", "provider_account")
    serializer_class = InstanceSerializer
    filterset_class = InstanceFilter
    ordering_fields = ("created_at", "ready_at", "claimed_at", "status")
    ordering = ("-created_at",)
    required_roles = {"release": "member"}

    def retrieve(self, request: Request, *args: object, **kwargs: object) -> Response:
        """The instance, with ``cost_detail``: billed (live: committed to the end of its paid
        period) and accrued so far, split into job / warm / idle / tail, and per job."""
        instance = self.get_object()
        data = dict(self.get_serializer(instance).data)
        data["cost_detail"] = {
            **instance_cost(instance, now=timezone.now()),
            "currency": settings.CATACLOUD_CURRENCY,
        }
        return Response(data)

    @extend_schema(request=None, responses={202: TerminateOut})
    @action(detail=True, methods=["post"])
    def terminate(self, request: Request, pk: str | None = None) -> Response:
        """Destroy the machine at the provider; its pool sees the deficit and replaces it."""
        instance = instance_terminate(
            instance_id=self.get_object().pk, actor=self.actor(), reason="terminated through the API"
        )
        return Response({"id": instance.pk, "status": instance.status}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=ReleaseIn, responses={202: TerminateOut})
    @action(detail=True, methods=["post"])
    def release(self, request: Request, pk: str | None = None) -> Response:
        """Hand back a machine acquired from a pool. A used machine never returns to a pool:
        it is terminated and the pool refills. A repeat answers 202 again; a machine held
        by a job answers 409 (cancel the job instead)."""
        body = ReleaseIn(data=request.data)
        body.is_valid(raise_exception=True)
        instance = instance_release_claim(
            instance_id=self.get_object().pk, claim_id=body.validated_data.get("claim_id"), actor=self.actor()
        )
        return Response({"id": instance.pk, "status": instance.status}, status=status.HTTP_202_ACCEPTED)


# ---- costs and budgets ------------------------------------------------------------------------

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
