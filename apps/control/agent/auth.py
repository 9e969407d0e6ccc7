"""Who may call the Agent API: an agent, by its token (``Authorization: Agent <token>``), for its
own instance only, within ``CATACLOUD_AGENT_RATE``. The base of every DRF view of the package."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from apps.core.throttling import LocalThrottleMixin
from apps.machines.agents import AGENT_TOKEN_PREFIX, instance_for_agent_token
from apps.machines.models import MachineInstance


class AgentAuthentication(BaseAuthentication):
    keyword = "Agent"

    def authenticate(self, request: Request) -> tuple[Any, MachineInstance] | None:
        parts = get_authorization_header(request).decode("latin-1").split()
        if not parts or parts[0] != self.keyword:
            return None
        if len(parts) != 2 or not parts[1].startswith(f"{AGENT_TOKEN_PREFIX}_"):
            raise exceptions.AuthenticationFailed("invalid agent token")
        instance = instance_for_agent_token(parts[1])
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
