"""The Agent API: the only surface agents on machines talk to (``/api/agent/v1/``).

A separate principal: ``Authorization: Agent <token>`` with a per-instance agent token
obtained by exchanging the single-use bootstrap token. Agent tokens reach only these
endpoints and only their own instance's data; user (Bearer) tokens cannot reach them.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from rest_framework import exceptions, serializers, status
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from apps.core import hooks
from apps.core.broker import enqueue_on_commit
from apps.core.crypto import hash_token, new_token
from apps.core.errors import Conflict, ErrorCode, InvalidTransition, Unauthenticated
from apps.core.throttling import LocalThrottleMixin
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.lifecycle import REFRESH_PROVIDER_STATE_TASK, bootstrap_token_instance
from apps.machines.models import MachineInstance
from apps.machines.services import INSTANCE_STATES

log = logging.getLogger(__name__)
AGENT_TOKEN_PREFIX = "ca"


class AgentAuthentication(BaseAuthentication):
    keyword = "Agent"

    def authenticate(self, request: Request) -> tuple[Any, MachineInstance] | None:
        parts = get_authorization_header(request).decode("latin-1").split()
        if not parts or parts[0] != self.keyword:
            return None
        if len(parts) != 2 or not parts[1].startswith(f"{AGENT_TOKEN_PREFIX}_"):
            raise exceptions.AuthenticationFailed("invalid agent token")
        instance = (
            MachineInstance.objects.filter(agent_token_hash=hash_token(parts[1]), status__in=INSTANCE_LIVE)
            .select_related("machine_type")
            .first()
        )
        if instance is None:
            raise exceptions.AuthenticationFailed("unknown agent token, or the machine has ended")
        return AgentPrincipal(instance), instance

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class AgentPrincipal:
    """``request.user`` for agents: authenticated, but no user of any organization."""

    is_authenticated = True
    is_active = True
    is_staff = False
    is_superuser = False

    def __init__(self, instance: MachineInstance) -> None:
        self.instance = instance
        self.pk = None

    def get_username(self) -> str:
        return f"agent:{self.instance.pk}"


class IsAgent(BasePermission):
    def has_permission(self, request: Request, view: APIView) -> bool:
        return isinstance(request.auth, MachineInstance)


class AgentRateThrottle(LocalThrottleMixin, SimpleRateThrottle):
    """Requests per agent (``CATACLOUD_AGENT_RATE``): one machine cannot starve the API.
    Counted in the web process's memory like the user throttle (no Redis round trip per
    heartbeat); fails open on any error: agents must keep heartbeating."""

    scope = "agent"

    def get_rate(self) -> str:
        return settings.CATACLOUD_AGENT_RATE

    def get_cache_key(self, request: Request, view: APIView) -> str | None:
        instance = request.auth
        return f"throttle_agent_{instance.pk}" if isinstance(instance, MachineInstance) else None

    def allow_request(self, request: Request, view: APIView) -> bool:
        self.rate = self.get_rate()  # read per request: the setting may change in tests
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)


class AgentView(APIView):
    schema = None  # not part of the public API document
    authentication_classes = [AgentAuthentication]
    permission_classes = [IsAgent]
    throttle_classes: list = [AgentRateThrottle]

    @property
    def instance(self) -> MachineInstance:
        return self.request.auth  # type: ignore[return-value]  # AgentAuthentication's answer


# ---- enroll and heartbeat ---------------------------------------------------------------------


class LimitsIn(serializers.Serializer):
    cpus = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    memory_mb = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    pids = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    enforced = serializers.BooleanField(required=False)
    by = serializers.CharField(max_length=32, required=False, allow_blank=True)
    detail = serializers.CharField(max_length=300, required=False, allow_blank=True)


class IsolationIn(serializers.Serializer):
    jobs = serializers.CharField(max_length=32, required=False, allow_blank=True)
    job_uids = serializers.CharField(max_length=64, required=False, allow_blank=True)
    proc = serializers.CharField(max_length=16, required=False, allow_blank=True)


class MachineIn(serializers.Serializer):
    """How the machine isolates jobs and which limits hold: kept on the instance as reported."""

    isolation = IsolationIn(required=False)
    limits = LimitsIn(required=False)


class EnrollIn(serializers.Serializer):
    bootstrap_token = serializers.CharField(max_length=200)
    hostname = serializers.CharField(max_length=200, required=False, allow_blank=True)
    agent_version = serializers.CharField(max_length=50, required=False, allow_blank=True)
    machine = MachineIn(required=False)


class EnrollView(APIView):
    """Exchange the single-use bootstrap token for this instance's agent token."""

    schema = None
    authentication_classes: list = []
    permission_classes: list = []
    throttle_classes: list = []

    def post(self, request: Request) -> Response:
        data = EnrollIn(data=request.data)
        data.is_valid(raise_exception=True)
        instance_id = bootstrap_token_instance(data.validated_data["bootstrap_token"])
        if instance_id is None:
            raise Unauthenticated("this bootstrap token is not valid", code=ErrorCode.INVALID_BOOTSTRAP_TOKEN)
        secret = new_token(AGENT_TOKEN_PREFIX)
        with transaction.atomic():
            enrolled = MachineInstance.objects.filter(
                pk=instance_id,
                agent_token_hash="",
                status__in=[InstanceStatus.PROVISIONING, InstanceStatus.WARMING],
            ).update(
                agent_token_hash=hash_token(secret),
                last_heartbeat_at=timezone.now(),
                isolation=_isolation(data.validated_data.get("machine") or {}),
            )
            if not enrolled:
                row = (
                    MachineInstance.objects.filter(pk=instance_id)
                    .values("agent_token_hash", "status")
                    .first()
                )
                if row is None or row["status"] not in INSTANCE_LIVE:
                    raise Unauthenticated(
                        "this machine is unknown or has ended", code=ErrorCode.INVALID_BOOTSTRAP_TOKEN
                    )
                raise Conflict("this bootstrap token was already used", code=ErrorCode.ALREADY_ENROLLED)
            instance = MachineInstance.objects.get(pk=instance_id)
            event_record(
                kind=EventKind.AGENT_ENROLLED,
                org=instance.org_id,
                pool=instance.pool_id,
                instance=instance,
                actor=f"agent:{instance.pk}",
                hostname=data.validated_data.get("hostname", ""),
                agent_version=data.validated_data.get("agent_version", ""),
                isolation=instance.isolation,
            )
        return Response(
            {
                "instance_id": str(instance_id),
                "agent_token": secret,
                "heartbeat_interval": settings.CATACLOUD_HEARTBEAT_INTERVAL,
                "poll_timeout": settings.CATACLOUD_AGENT_POLL_TIMEOUT,
            }
        )


def _isolation(machine: dict) -> dict:
    """The instance's ``isolation``: the agent's report flattened (jobs, job uids, limits)."""
    return {**machine.get("isolation", {}), "limits": dict(machine.get("limits", {}))}


def instance_heartbeat(*, instance: MachineInstance) -> bool:
    """Record a heartbeat; the first one after enrolment makes a warming instance ready."""
    now = timezone.now()
    MachineInstance.objects.filter(pk=instance.pk).update(last_heartbeat_at=now)
    if instance.status != InstanceStatus.WARMING:
        return False
    try:
        with transaction.atomic():
            ready = INSTANCE_STATES.move(
                instance.pk,
                to=InstanceStatus.READY,
                from_=[InstanceStatus.WARMING],
                actor=f"agent:{instance.pk}",
                reason="agent handshake",
                event=EventKind.POOL_MEMBER_WARMED if instance.pool_id else EventKind.INSTANCE_READY,
                warmed_at=now,
                now=now,
            )
            if ready.pool_id:
                hooks.pool_member_left(ready.pool_id)  # the pool re-evaluates its status and deficit
            # the scheduler may place a waiting job on it
            hooks.machine_available(org_id=ready.org_id, machine_type_id=ready.machine_type_id)
            # provider_state still says what the create answered ("booting", "initializing"):
            # ask the provider again now that the machine runs (off the request, after commit).
            enqueue_on_commit(REFRESH_PROVIDER_STATE_TASK, str(instance.pk))
    except InvalidTransition:
        return False
    return True


def machine_agent_urls() -> list:
    from django.urls import path

    return [
        path("enroll", EnrollView.as_view(), name="agent-enroll"),
    ]


__all__ = ["AgentView", "machine_agent_urls", "status"]
