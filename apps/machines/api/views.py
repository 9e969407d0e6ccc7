from __future__ import annotations

from typing import Any

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
from apps.core.errors import ErrorCode, PermissionDenied
from apps.machines.api.serializers import (
    EnrolmentTokenCreated,
    EnrolmentTokenIn,
    EnrolmentTokenSerializer,
    HostCordonIn,
    HostSerializer,
    HostUpdateIn,
    InstanceSerializer,
    MachineTypeSerializer,
    OwnMachineTypeIn,
    ProviderAccountIn,
    ProviderAccountSerializer,
    ProviderAccountUpdateIn,
)
from apps.machines.choices import HostStatus, InstanceStatus
from apps.machines.costs import instance_cost
from apps.machines.hostops import host_cordon, host_revoke, host_uncordon, host_update
from apps.machines.hosts import enrolment_token_create, enrolment_token_revoke, hosts_usage
from apps.machines.lifecycle import instance_release_claim, instance_terminate
from apps.machines.models import EnrolmentToken, Host, MachineInstance, MachineType, ProviderAccount
from apps.machines.owned import (
    org_account_create,
    org_account_delete,
    org_account_update,
    org_machine_type_create,
    org_machine_type_delete,
    org_machine_type_update,
    own_machine_type,
)
from apps.machines.selectors import hosts_for_org, machine_types_for_org
from apps.orgs.api.base import IdPrefixFilter, OrgScopedFilterSet, OrgScopedViewSet


class MachineTypeFilter(OrgScopedFilterSet):
    provider = django_filters.CharFilter(field_name="provider_account__kind")

    class Meta:
        model = MachineType
        fields = {"name": ["exact"], "spot": ["exact"], "gpus": ["gte"], "cpus": ["gte"]}


class MachineTypeViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Machine types the organization may use, with its quota on each: the operator's granted
    ones, and its own (on its own provider accounts), which its admins create, change and
    delete here."""

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
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def _answer(self, mt: MachineType, status_code: int = status.HTTP_200_OK) -> Response:
        return Response(self.get_serializer(self.get_queryset().get(pk=mt.pk)).data, status=status_code)

    @extend_schema(request=OwnMachineTypeIn, responses={201: MachineTypeSerializer})
    def create(self, request: Request) -> Response:
        """A machine type on your organization's own provider account: only your organization
        sees and uses it, and ``limits`` are your own guard rails on it (quota fields)."""
        body = OwnMachineTypeIn(data=request.data, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        fields = dict(body.validated_data)
        mt = org_machine_type_create(
            org=self.ctx.org,
            actor=self.actor(),
            name=fields.pop("name"),
            account=fields.pop("provider_account"),
            limits=fields.pop("limits", None),
            **fields,
        )
        return self._answer(mt, status.HTTP_201_CREATED)

    @extend_schema(request=OwnMachineTypeIn, responses=MachineTypeSerializer)
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Change one of your own machine types (the operator's: 403 ``operators_own``)."""
        mt = own_machine_type(org=self.ctx.org, machine_type=self.get_object())
        body = OwnMachineTypeIn(data=request.data, partial=True, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        fields = dict(body.validated_data)
        limits = fields.pop("limits", None)
        mt = org_machine_type_update(
            org=self.ctx.org, machine_type=mt, actor=self.actor(), limits=limits, **fields
        )
        return self._answer(mt)

    def destroy(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Delete one of your own machine types that no machine, pool or configuration uses."""
        org_machine_type_delete(org=self.ctx.org, machine_type=self.get_object(), actor=self.actor())
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProviderAccountViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Your organization's own cloud accounts (hetzner, aws, azure, as the operator allows):
    admins add them (the credentials are checked with the provider first, stored encrypted and
    never shown again), change and delete them. The operator's accounts are not listed."""

    queryset = ProviderAccount.objects.prefetch_related("machine_types")
    serializer_class = ProviderAccountSerializer
    ordering_fields = ("name", "created_at")
    ordering = ("name",)
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    @extend_schema(request=ProviderAccountIn, responses={201: ProviderAccountSerializer})
    def create(self, request: Request) -> Response:
        """Add an account once one cheap read call with its credentials succeeded at the
        provider (its refusal: 400 ``provider_check_failed`` with the provider's words)."""
        body = ProviderAccountIn(data=request.data)
        body.is_valid(raise_exception=True)
        account = org_account_create(org=self.ctx.org, actor=self.actor(), **body.validated_data)
        return Response(self.get_serializer(account).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ProviderAccountUpdateIn, responses=ProviderAccountSerializer)
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Rename it, or change its config or credentials (checked with the provider again)."""
        account = self.get_object()
        body = ProviderAccountUpdateIn(data=request.data)
        body.is_valid(raise_exception=True)
        account = org_account_update(
            org=self.ctx.org, account=account, actor=self.actor(), **body.validated_data
        )
        return Response(self.get_serializer(account).data)

    def destroy(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Delete an account no machine type uses any more."""
        org_account_delete(org=self.ctx.org, account=self.get_object(), actor=self.actor())
        return Response(status=status.HTTP_204_NO_CONTENT)


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


# ---- enrolled hosts and their enrolment tokens ---------------------------------------------------


class EnrolmentTokenFilter(django_filters.FilterSet):
    revoked = django_filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)
    id_prefix = IdPrefixFilter()

    class Meta:
        model = EnrolmentToken
        fields = ("prefix", "revoked")


class EnrolmentTokenViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The organization's enrolment tokens: what its hosts enroll with (``catacloud host``).
    Admins create them (the token is shown once, in the answer; only its hash is stored) and
    revoke them; everyone reads their prefix, labels, uses and expiry. The operator's shared
    tokens are not listed (the console has them)."""

    queryset = EnrolmentToken.objects.select_related("provider_account")
    serializer_class = EnrolmentTokenSerializer
    filterset_class = EnrolmentTokenFilter
    ordering_fields = ("created_at", "expires_at")
    ordering = ("-created_at",)

    @extend_schema(request=EnrolmentTokenIn, responses={201: EnrolmentTokenCreated})
    def create(self, request: Request) -> Response:
        """A token hosts enroll with, scoped to your organization (only its jobs run on them),
        with labels the hosts get; single-use unless ``max_uses`` says more; it expires after
        ``ttl_seconds``. The answer's ``token`` is shown this once."""
        body = EnrolmentTokenIn(data=request.data, context=self.get_serializer_context())
        body.is_valid(raise_exception=True)
        token, secret = enrolment_token_create(org=self.ctx.org, actor=self.actor(), **body.validated_data)
        data = {**EnrolmentTokenSerializer(token).data, "token": secret}
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=EnrolmentTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """No host enrolls with it any more (hosts that did keep their own credential: revoke
        those one by one). A repeat answers the same."""
        token = enrolment_token_revoke(token_id=self.get_object().pk, actor=self.actor())
        return Response(EnrolmentTokenSerializer(token).data)


class HostFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=HostStatus.choices)
    shared = django_filters.BooleanFilter(field_name="org", lookup_expr="isnull")
    cordoned = django_filters.BooleanFilter(field_name="cordoned_at", lookup_expr="isnull", exclude=True)
    id_prefix = IdPrefixFilter()

    class Meta:
        model = Host
        fields = ("name", "status", "shared", "cordoned")


SHARED_HOST = (
    "host {name} is shared by the operator (it runs every granted organization's jobs): only the "
    "operator manages it, in the console"
)


class HostViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Enrolled hosts: the organization's own, and the operator's shared hosts where it holds a
    grant (read only). Each with its capacity, what its live slots take now, cordon and drain,
    and when its agent was last heard. Admins cordon, drain, uncordon, revoke and change their
    own org's hosts."""

    queryset = Host.objects.none()  # get_queryset: hosts_for_org
    serializer_class = HostSerializer
    filterset_class = HostFilter
    ordering_fields = ("name", "status", "last_seen_at", "enrolled_at")
    ordering = ("name",)
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_queryset(self) -> QuerySet[Host]:
        if getattr(self, "swagger_fake_view", False):
            return Host.objects.none()
        return hosts_for_org(org=self.ctx.org)

    def get_serializer(self, *args: Any, **kwargs: Any) -> Any:
        """The hosts answered, each with what its live slots take now (one grouped query)."""
        if args and not kwargs.get("data"):
            hosts = list(args[0]) if kwargs.get("many") else [args[0]]
            usage = hosts_usage(h.pk for h in hosts)
            for host in hosts:
                host.usage = usage.get(host.pk)
            args = (hosts if kwargs.get("many") else hosts[0], *args[1:])
        return super().get_serializer(*args, **kwargs)

    def _own(self) -> Host:
        """The host of the path, when the caller's org owns it; a shared one is 403."""
        host = self.get_object()
        if host.org_id != self.ctx.org.pk:
            raise PermissionDenied(SHARED_HOST.format(name=host.name), code=ErrorCode.SHARED_HOST)
        return host

    def _answer(self, host: Host) -> Response:
        return Response(self.get_serializer(hosts_for_org(org=self.ctx.org).get(pk=host.pk)).data)

    @extend_schema(request=HostUpdateIn, responses=HostSerializer)
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Change a host's ``monthly_price`` (cost attribution only) or ``labels`` (which
        machine types' slots it takes from now on; slots already on it stay)."""
        host = self._own()
        body = HostUpdateIn(data=request.data)
        body.is_valid(raise_exception=True)
        host = host_update(host_id=host.pk, actor=self.actor(), **body.validated_data)
        return self._answer(host)

    @extend_schema(request=HostCordonIn, responses=HostSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        """No new job on the host; its idle slots end and running jobs finish. With
        ``drain_seconds``: jobs still running after that are requeued elsewhere (a drain)."""
        host = self._own()
        body = HostCordonIn(data=request.data)
        body.is_valid(raise_exception=True)
        drain = body.validated_data.get("drain_seconds")
        return self._answer(host_cordon(host_id=host.pk, actor=self.actor(), drain_seconds=drain))

    @extend_schema(request=None, responses=HostSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        """Jobs may be placed on the host again (a drain's deadline is dropped)."""
        return self._answer(host_uncordon(host_id=self._own().pk, actor=self.actor()))

    @extend_schema(request=None, responses=HostSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """For good: the host's credential is refused from now on and its jobs are requeued
        elsewhere. To use the machine again, enroll it with a new token."""
        return self._answer(host_revoke(host_id=self._own().pk, actor=self.actor()))
