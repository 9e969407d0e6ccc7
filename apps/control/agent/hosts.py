"""The Agent API of enrolled hosts (``catacloud host``; apps.machines.hosts says what they are):

- ``POST hosts/enroll``: an enrolment token for the host's own credential (returned once).
- ``POST hosts/exchange?wait=S`` (``Authorization: Agent ch_…``): the host's report (the slots
  it runs, what it has) for what to start and stop. With nothing to do it waits up to ``wait``
  seconds for a wake-up (a slot requested on it, one ended), holding no thread and no database
  connection, as a machine's long poll does; its answer says everything again each time.

Each slot then is a machine with its own agent and its own token: the machines' Agent API
serves it, nothing here.
"""

from __future__ import annotations

import math
import time
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.control.agent import db, wakeups
from apps.control.agent.views import Answer, _response, error_answer, method_not_allowed
from apps.core.errors import ErrorCode, UpgradeRequired, ValidationFailed
from apps.core.parsers import loads
from apps.machines.hosts import HOST_TOKEN_PREFIX, HOST_WAKE, host_enroll, host_exchange, host_for_token
from catacloud.protocol import OLDEST_AGENT, HostAnswer, HostEnroll, HostEnrollAnswer, HostReport
from catacloud.protocol import VERSION as PROTOCOL_VERSION


class HostEnrollIn(serializers.Serializer):
    """The bounds of what an enrolment may carry; its shape is catacloud.protocol's HostEnroll."""

    enrolment_token = serializers.CharField(max_length=200)
    hostname = serializers.CharField(max_length=200, allow_blank=True)
    capacity = serializers.JSONField()
    agent_version = serializers.CharField(max_length=50, required=False, allow_blank=True)
    protocol = serializers.IntegerField(min_value=0, required=False)


class HostEnrollView(APIView):
    """Exchange an enrolment token for the host's own credential."""

    schema = None
    authentication_classes: list = []
    permission_classes: list = []
    throttle_classes: list = []

    def post(self, request: Request) -> Response:
        data = HostEnrollIn(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            enroll = HostEnroll.from_json(data.validated_data)
        except ValueError as exc:
            raise ValidationFailed(f"capacity: {exc}") from None
        if enroll.protocol < OLDEST_AGENT:
            raise UpgradeRequired(
                f"this agent speaks protocol {enroll.protocol}; this control plane needs "
                f"{OLDEST_AGENT} or later (it speaks {PROTOCOL_VERSION}): upgrade catacloud-agent"
            )
        host, secret = host_enroll(
            enrolment_token=enroll.enrolment_token,
            hostname=enroll.hostname,
            capacity=enroll.capacity,
            agent_version=enroll.agent_version,
        )
        answer = HostEnrollAnswer(
            host_id=str(host.pk),
            host_token=secret,
            heartbeat_interval=settings.CATACLOUD_HEARTBEAT_INTERVAL,
            poll_timeout=exchange_wait_limit(),
        )
        return Response(answer.to_json())


def exchange_wait_limit() -> float:
    """How long an exchange may wait: a host that waits reports again within it, so its silence
    past the lost deadline means it is gone."""
    return max(1.0, min(settings.CATACLOUD_AGENT_POLL_TIMEOUT, settings.CATACLOUD_AGENT_LOST_AFTER / 3))


def _host_token(authorization: str) -> str | Answer:
    parts = authorization.split()
    if len(parts) != 2 or parts[0] != "Agent":
        return error_answer(
            401,
            ErrorCode.NOT_AUTHENTICATED,
            "Authentication credentials were not provided.",
            WWW_Authenticate="Agent",
        )
    if not parts[1].startswith(f"{HOST_TOKEN_PREFIX}_"):
        return error_answer(
            401, ErrorCode.AUTHENTICATION_FAILED, "not a host's token", WWW_Authenticate="Agent"
        )
    return parts[1]


def _report(body: bytes) -> HostReport | Answer:
    try:
        parsed: Any = loads(body) if body else {}
        if not isinstance(parsed, dict):
            raise ValueError("the request body must be a JSON object")
        return HostReport.from_json(parsed)
    except ValueError as exc:
        return error_answer(400, ErrorCode.INVALID, f"the host's report: {exc}")


def _wait_seconds(wait_param: str | None) -> float:
    limit = exchange_wait_limit()
    try:
        wait = float(wait_param) if wait_param is not None else 0.0
    except ValueError:
        wait = 0.0
    return 0.0 if math.isnan(wait) else max(0.0, min(wait, limit))


async def exchange_answer(authorization: str, body: bytes, wait_param: str | None) -> Answer:
    """``POST hosts/exchange?wait=S`` → ``HostAnswer``: at once when there is something to start
    or stop, else when woken or after ``wait`` seconds."""
    token = _host_token(authorization)
    if isinstance(token, Answer):
        return token
    report = _report(body)
    if isinstance(report, Answer):
        return report
    host = await db.run(host_for_token, token)
    if host is None:
        return error_answer(
            401, ErrorCode.AUTHENTICATION_FAILED, "unknown or revoked host token", WWW_Authenticate="Agent"
        )
    deadline = time.monotonic() + _wait_seconds(wait_param)
    async with wakeups.waiter_for(HOST_WAKE.format(host.pk)) as waiter:
        while True:  # subscribed before looking: a slot requested from now on wakes this exchange
            orders = await db.run(host_exchange, host=host, report=report)
            remaining = deadline - time.monotonic()
            if orders.start or orders.stop or remaining <= 0:
                answer = HostAnswer(
                    start=tuple(orders.start), stop=tuple(orders.stop), cordoned=orders.cordoned
                )
                return Answer(200, answer.to_json())
            await waiter.wait(remaining)


@csrf_exempt  # authenticated by the host's token header, never by a cookie
async def exchange(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _response(method_not_allowed(str(request.method), "POST"))
    answer = await exchange_answer(
        request.headers.get("Authorization", ""), request.body, request.GET.get("wait")
    )
    return _response(answer)
