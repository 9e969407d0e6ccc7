"""A machine's agent: its token, its enrolment and its heartbeat (services; the Agent API's
views are apps/control/agent/).

An agent is a separate principal: ``Authorization: Agent <token>`` with a per-instance agent
token obtained by exchanging the single-use bootstrap token. Agent tokens reach only the Agent
API and only their own instance's data; user (Bearer) tokens cannot reach it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.core import hooks
from apps.core.actors import Actor
from apps.core.broker import enqueue_on_commit
from apps.core.crypto import hash_token, new_token
from apps.core.db import sql_literals
from apps.core.errors import Conflict, ErrorCode, InvalidTransition, Unauthenticated
from apps.core.ids import InstanceId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.lifecycle import REFRESH_PROVIDER_STATE_TASK, bootstrap_token_instance
from apps.machines.models import MachineInstance
from apps.machines.services import INSTANCE_STATES
from catacloud.protocol import HeldImage, ImagesReport, MachineReport

AGENT_TOKEN_PREFIX = "ca"
IMAGE_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")


def live_token_sql(alias: str) -> str:
    """The SQL condition that machine ``alias`` has an agent token and is live (the Agent API's
    hot statements add ``{alias}.agent_token_hash = <the token's hash>``)."""
    return f"{alias}.agent_token_hash <> '' AND {alias}.status IN ({sql_literals(INSTANCE_LIVE)})"


# At most this many references of a machine's images are kept for placement.
MAX_HELD_REFERENCES = 500


def instance_for_agent_token(token: str) -> MachineInstance | None:
    """The live instance whose agent holds ``token`` (with its machine type), or None."""
    return (
        MachineInstance.objects.filter(agent_token_hash=hash_token(token), status__in=INSTANCE_LIVE)
        .select_related("machine_type")
        .first()
    )


def agent_enroll(
    *, bootstrap_token: str, hostname: str = "", agent_version: str = "", machine: MachineReport
) -> tuple[MachineInstance, str]:
    """Exchange a machine's single-use bootstrap token for its agent token (returned once, stored
    hashed), recording how the machine isolates jobs (``machine``: the agent's report). 401
    ``invalid_bootstrap_token`` for a forged, expired or ended machine's token; 409
    ``already_enrolled`` for one used before."""
    instance_id = bootstrap_token_instance(bootstrap_token)
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
            isolation=_isolation(machine),
        )
        if not enrolled:
            row = MachineInstance.objects.filter(pk=instance_id).values("agent_token_hash", "status").first()
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
            actor=Actor.agent(instance.pk),
            hostname=hostname,
            agent_version=agent_version,
            isolation=instance.isolation,
        )
    return instance, secret


def agent_settings() -> dict[str, float]:
    """What an enrolled agent is told: how often to heartbeat, how long a poll waits."""
    return {
        "heartbeat_interval": settings.CATACLOUD_HEARTBEAT_INTERVAL,
        "poll_timeout": settings.CATACLOUD_AGENT_POLL_TIMEOUT,
    }


def _isolation(machine: MachineReport) -> dict[str, Any]:
    """The instance's ``isolation``: the agent's report flattened (jobs, job uids, its network,
    limits)."""
    return {**machine.isolation.to_json(), "limits": machine.limits.to_json()}


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
                actor=Actor.agent(instance.pk),
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


def instance_images_set(*, instance_id: InstanceId, held: Sequence[HeldImage]) -> None:
    """What the machine's image store holds (every reference and digest), for placement."""
    references = sorted({ref for image in held for ref in (*image.references, image.digest) if ref})
    MachineInstance.objects.filter(pk=instance_id).update(images=references[:MAX_HELD_REFERENCES])


def instance_images_report(*, instance: MachineInstance, report: ImagesReport) -> None:
    """A pool member's images pulled before it is ready (``instance.image_pulled`` or
    ``instance.image_pull_failed`` each), and what its store holds."""
    with transaction.atomic():
        for pull in report.pulls[:50]:
            failed = bool(pull.code) or not IMAGE_DIGEST.match(pull.digest)
            event_record(
                kind=EventKind.INSTANCE_IMAGE_PULL_FAILED if failed else EventKind.INSTANCE_IMAGE_PULLED,
                org=instance.org_id,
                pool=instance.pool_id,
                instance=instance,
                actor=Actor.agent(instance.pk),
                reason=pull.detail[:500] if failed else "",
                image=pull.reference[:512],
                **(
                    {"code": pull.code[:32]}
                    if failed
                    else {
                        "digest": pull.digest,
                        "pulled": pull.pulled,
                        "bytes": pull.bytes,
                        "seconds": pull.seconds,
                    }
                ),
            )
        instance_images_set(instance_id=instance.pk, held=report.held)
