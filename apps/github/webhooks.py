"""``POST /api/integrations/github/webhook``: GitHub's deliveries.

No API token: the signature is the credential. In order, and writing nothing until the last
step: the size (413), the content type (415), ``X-Hub-Signature-256`` checked against the
raw body with HMAC-SHA256 in constant time (401 ``invalid_signature``) for the connections
of the App the delivery names (``X-GitHub-Hook-Installation-Target-ID``; every connection when
it names none), the headers (400), the JSON (400 ``parse_error``). A delivery for an
installation no organization connected (through a connection whose secret signed it) is
answered 202 and ignored. Otherwise it is stored, keyed by ``X-GitHub-Delivery`` (a
redelivery is a no-op), then acted on in a second transaction, and answered before any
GitHub call (GitHub waits 10 s and never retries by itself): the CI core's intake
(apps.ci.intake). A delivery stored but not acted on (a crash between the two) is acted on by
the reaper's rule.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.ci import intake
from apps.ci.intake import error as _error
from apps.core.errors import ErrorCode
from apps.github.forge import GITHUB
from apps.github.models import GitHubConnection, GitHubInstallation

SIGNATURE = re.compile(r"^sha256=([0-9a-f]{64})$")
GUID = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def sign(secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value GitHub sends for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signature_valid(secret: str, body: bytes, header: str) -> bool:
    """Constant-time check of ``header`` against the HMAC-SHA256 of the raw ``body``."""
    if not secret or not SIGNATURE.match(header or ""):
        return False
    return hmac.compare_digest(sign(secret, body), header)


def _candidates(request: HttpRequest) -> list[GitHubConnection]:
    target = request.headers.get("X-GitHub-Hook-Installation-Target-ID", "")
    connections = GitHubConnection.objects.all()
    if target.isdigit() and request.headers.get("X-GitHub-Hook-Installation-Target-Type", "integration") in (
        "integration",
        "",
    ):
        connections = connections.filter(app_id=int(target))
    return list(connections)


@csrf_exempt
def webhook(request: HttpRequest) -> JsonResponse:
    body = intake.read_body(request, limit=settings.CATACLOUD_GITHUB_WEBHOOK_MAX_BYTES)
    if isinstance(body, JsonResponse):
        return body
    header = request.headers.get("X-Hub-Signature-256", "")
    if not header:
        return _error(
            401, ErrorCode.INVALID_SIGNATURE, "X-Hub-Signature-256 is missing: deliveries must be signed"
        )
    verified = [c for c in _candidates(request) if signature_valid(c.webhook_secret, body, header)]
    if not verified:
        return _error(
            401, ErrorCode.INVALID_SIGNATURE, "X-Hub-Signature-256 does not match any connected App's secret"
        )
    event = request.headers.get("X-GitHub-Event", "")
    guid = request.headers.get("X-GitHub-Delivery", "")
    if not event or not GUID.match(guid):
        return _error(400, ErrorCode.INVALID, "X-GitHub-Event and X-GitHub-Delivery are required")
    payload = intake.read_json(body)
    if isinstance(payload, JsonResponse):
        return payload
    installation_id = (
        (payload.get("installation") or {}).get("id")
        if isinstance(payload.get("installation"), dict)
        else None
    )
    if event == "ping":
        return JsonResponse({"status": "pong"})
    installation = (
        GitHubInstallation.objects.filter(connection__in=verified, installation_id=installation_id)
        .select_related("connection")
        .first()
        if isinstance(installation_id, int)
        else None
    )
    if installation is None:
        return JsonResponse(
            {"status": "ignored", "detail": "no organization connected this installation"}, status=202
        )
    action = str(payload.get("action") or "")[:64]
    return intake.delivery_received(
        forge=GITHUB, key=guid, endpoint=installation, event=event, action=action, payload=payload
    )


def delivery_process(*, guid: str) -> str:
    """Act on a stored delivery once (a delivery being processed elsewhere is skipped)."""
    return intake.delivery_process(forge=GITHUB, key=guid)


def deliveries_process(*, older_than_seconds: float = 5.0, limit: int = 200) -> int:
    """Deliveries stored but never acted on (their request crashed in between)."""
    return intake.deliveries_process(forge=GITHUB, older_than_seconds=older_than_seconds, limit=limit)
