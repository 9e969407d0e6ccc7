from __future__ import annotations

import uuid
from typing import Any

import django_filters
from django.db import transaction
from django.db.models import Prefetch
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.orgs.api.base import IdPrefixFilter, OrgScopedModelViewSet
from apps.pools.api.serializers import (
    AcquireIn,
    AcquireOut,
    DrainIn,
    DrainOut,
    PoolSerializer,
    PoolUpdateSerializer,
    live_members,
)
from apps.pools.choices import PoolStatus
from apps.pools.models import InstancePool
from apps.pools.services import pool_claim, pool_create, pool_delete, pool_drain, pool_update


def _named_relations(instance: MachineInstance) -> None:
    """Attach what the answer names (machine type name, provider kind) from the values the
    claim statement returned with the row: no second query on the hot path."""
    row: Any = instance  # the claim statement's extra columns ride on the row
    instance.machine_type = MachineType(
        pk=instance.machine_type_id,
        name=row.machine_type_name,
        server_type=row.machine_server_type,
        location=row.machine_location,
    )
    instance.provider_account = ProviderAccount(
        pk=instance.provider_account_id,
        kind=row.provider_kind,
        config={"ssh_user": row.ssh_user} if row.ssh_user else {},
    )


_ACQUIRE_OUT = AcquireOut()


class PoolFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=PoolStatus.choices)
    machine_type = django_filters.CharFilter(field_name="machine_type__name")
    id_prefix = IdPrefixFilter()

    class Meta:
        model = InstancePool
        fields = ("name", "status", "machine_type")


class PoolViewSet(OrgScopedModelViewSet):
    """Warm pools: keep target_size machines ready; acquire one in milliseconds."""

    queryset = InstancePool.objects.select_related("machine_type").prefetch_related(
        "schedules", Prefetch("members", queryset=live_members(), to_attr="live_members")
    )
    serializer_class = PoolSerializer
    filterset_class = PoolFilter
    ordering_fields = ("name", "created_at", "target_size")
    ordering = ("name",)
    required_roles = {"acquire": "member"}
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def perform_create(self, serializer: BaseSerializer) -> None:
        data = serializer.validated_data
        serializer.instance = pool_create(org=self.ctx.org, actor=self.actor(), **data)

    @extend_schema(request=PoolUpdateSerializer, responses=PoolSerializer)
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        pool = self.get_object()
        data = PoolUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        pool = pool_update(pool=pool, actor=self.actor(), **data.validated_data)
        return Response(PoolSerializer(pool, context=self.get_serializer_context()).data)

    def perform_destroy(self, instance: InstancePool) -> None:
        pool_delete(pool=instance, actor=self.actor())

    @extend_schema(request=AcquireIn, responses={201: AcquireOut})
    @action(detail=True, methods=["post"])
    def acquire(self, request: Request, pk: str | None = None) -> Response:
        """Claim one ready member at once; 409 pool_empty when none is ready (never waits).

        The hot path: no pool lookup first; the claim statement itself is scoped to the
        caller's organization (another org's pool answers 404 like a missing one)."""
        try:
            pool_id = uuid.UUID(str(pk))
        except ValueError:
            raise NotFound("pool not found") from None
        data = AcquireIn(data=request.data)
        data.is_valid(raise_exception=True)
        claim = pool_claim(pool_id=pool_id, org_id=self.ctx.org.pk, actor=self.actor(), **data.validated_data)
        instance = claim.instance
        _named_relations(instance)
        # A serializer built once per process (building one per request cost more than the
        # claim); its output is exactly AcquireOut's.
        body = _ACQUIRE_OUT.to_representation({"claim_id": claim.claim_id, "instance": instance})
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=DrainIn, responses={200: DrainOut})
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        pool = self.get_object()
        data = DrainIn(data=request.data)
        data.is_valid(raise_exception=True)
        with transaction.atomic():
            count = pool_drain(
                pool=pool, terminate_members=data.validated_data["terminate_members"], actor=self.actor()
            )
        return Response({"drained": True, "terminated_count": count})
