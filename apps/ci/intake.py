"""Webhook intake, as every forge's does it: a delivery authenticated by the adapter (GitHub's
signature, GitLab's secret token, both compared in constant time) is stored by its idempotency
key (a redelivery is a no-op), then acted on in a second transaction, and answered before any
call to the forge. A delivery stored but not acted on (a crash between the two, or one waiting
for a forge call) is acted on by the reaper's rule (:func:`deliveries_process`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from apps.ci.forge import Forge, ops_of
from apps.ci.reconcile import poll_soon
from apps.core.errors import ErrorCode, error_payload

log = logging.getLogger(__name__)


def error(status: int, code: ErrorCode, detail: str) -> JsonResponse:
    return JsonResponse(error_payload(code, detail), status=status)


def read_body(request: HttpRequest, *, limit: int) -> bytes | JsonResponse:
    """The checks before authentication, writing nothing: the method (405), the size (413),
    the content type (415). Returns the raw body, or the answer refusing it."""
    if request.method != "POST":
        response = error(405, ErrorCode.METHOD_NOT_ALLOWED, f'Method "{request.method}" not allowed.')
        response["Allow"] = "POST"
        return response
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return error(400, ErrorCode.INVALID, "Content-Length is not a number")
    if declared > limit:
        return error(413, ErrorCode.PAYLOAD_TOO_LARGE, f"a delivery may have at most {limit} bytes")
    if (request.content_type or "") != "application/json":
        return error(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            "deliveries must be application/json (the webhook's content type)",
        )
    body = request.body
    if len(body) > limit:
        return error(413, ErrorCode.PAYLOAD_TOO_LARGE, f"a delivery may have at most {limit} bytes")
    return body


def read_json(body: bytes) -> dict[str, Any] | JsonResponse:
    """The delivery's JSON object, or the answer refusing it (400 ``parse_error``)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return error(400, ErrorCode.PARSE_ERROR, "the delivery is not valid JSON")
    if not isinstance(payload, dict):
        return error(400, ErrorCode.PARSE_ERROR, "the delivery must be a JSON object")
    return payload


def delivery_received(
    *, forge: Forge, key: str, endpoint: Any, event: str, action: str, payload: dict[str, Any]
) -> JsonResponse:
    """An authenticated delivery for one of our endpoints: stored by its idempotency key (a
    redelivery is answered ``duplicate`` and not acted on again), then acted on now; the answer."""
    if not delivery_store(
        forge=forge, key=key, endpoint=endpoint, event=event, action=action, payload=payload
    ):
        return JsonResponse({"status": "duplicate"})
    return JsonResponse({"status": delivery_act_now(forge=forge, key=key)}, status=200)


def delivery_store(
    *, forge: Forge, key: str, endpoint: Any, event: str, action: str, payload: dict[str, Any]
) -> bool:
    """Store a delivery by its idempotency key; False: it was stored before (a redelivery)."""
    try:
        with transaction.atomic():
            forge.delivery.objects.create(
                pk=key,
                **forge.of_endpoint(endpoint),
                org_id=endpoint.org_id,
                event=event[:64],
                action=action[:64],
                payload=payload,
            )
    except IntegrityError:
        return False
    poll_soon(
        forge=forge, endpoint_id=endpoint.pk, last_delivery_at=getattr(endpoint, "last_delivery_at", None)
    )
    return True


def delivery_act_now(*, forge: Forge, key: str) -> str:
    """Act on a delivery just stored, in the request that received it (an error leaves it
    stored for the reaper's rule: the forge must not see a failure)."""
    try:
        return delivery_process(forge=forge, key=key)
    except Exception:
        log.exception("%s delivery %s stored but not processed (the reaper will)", forge.title, key)
        return "stored"


def delivery_process(*, forge: Forge, key: str, hint: Mapping[str, Any] | None = None) -> str:
    """Act on a stored delivery once (a delivery being processed elsewhere is skipped).
    ``hint``: what a forge call learnt for it (GitLab: the job with its tags)."""
    with transaction.atomic():
        # of=self: without it the lock (and the skip) also takes the joined endpoint row, so a
        # delivery would be skipped whenever another one of its endpoint, or a reconcile's
        # claim, holds that row
        delivery = (
            forge.delivery.objects.select_for_update(skip_locked=True, no_key=True, of=("self",))
            .select_related(forge.endpoint_field)
            .filter(pk=key, processed_at__isnull=True)
            .first()
        )
        if delivery is None:
            return "done"
        outcome = ops_of(forge).act(forge, delivery, hint)
        if outcome is None:
            return "deferred"  # the adapter sent the forge call it needs; acted on after it
        forge.delivery.objects.filter(pk=key).update(processed_at=timezone.now(), outcome=outcome[:200])
    return outcome


def deliveries_process(*, forge: Forge, older_than_seconds: float = 5.0, limit: int = 200) -> int:
    """Deliveries stored but never acted on (their request crashed in between)."""
    cutoff = timezone.now() - timedelta(seconds=older_than_seconds)
    keys = list(
        forge.delivery.objects.filter(processed_at__isnull=True, received_at__lt=cutoff)
        .order_by("received_at")
        .values_list("pk", flat=True)[:limit]
    )
    for key in keys:
        delivery_process(forge=forge, key=key)
    return len(keys)
