from __future__ import annotations

import django_filters
from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.api import StrictFields
from apps.machines.api.serializers import InstanceSerializer, MachineTypeSerializer
from apps.machines.choices import InstanceStatus
from apps.machines.costs import instance_cost
from apps.machines.lifecycle import instance_release_claim, instance_terminate
from apps.machines.models import MachineInstance, MachineType
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
