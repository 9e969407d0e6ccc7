"""Bootstrap tokens: what a new machine's agent enrolls with, once.

``cb.<instance id>.<expiry, unix seconds>.<HMAC-SHA256>``, signed with the first key of
``CATACLOUD_BOOTSTRAP_KEYS`` and verified against every key of it (rotation: put a new key
first, keep the old one until every machine started before the change has enrolled or ended,
then drop it). The expiry is the instance's creation time plus
``CATACLOUD_BOOTSTRAP_TOKEN_TTL``, so a provision task retried after a crash puts the same
token into the same machine; single use is enforced by the instance row.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from django.conf import settings

from apps.core.ids import InstanceId


def _mac(key: str, instance_id: str, expires: int) -> str:
    derived = hashlib.sha256(f"catacloud-bootstrap:{key}".encode()).digest()
    return hmac.new(derived, f"{instance_id}.{expires}".encode(), hashlib.sha256).hexdigest()


def token_for(instance_id: InstanceId) -> str:
    from apps.machines.models import MachineInstance

    created = MachineInstance.objects.values_list("created_at", flat=True).get(pk=instance_id)
    expires = int(created.timestamp()) + int(settings.CATACLOUD_BOOTSTRAP_TOKEN_TTL)
    mac = _mac(settings.CATACLOUD_BOOTSTRAP_KEYS[0], str(instance_id), expires)
    return f"cb.{instance_id}.{expires}.{mac}"


def token_instance(token: str, *, now: float | None = None) -> str | None:
    """The instance id a genuine, unexpired token belongs to, else None."""
    try:
        prefix, instance_id, expires_text, mac = token.split(".")
        expires = int(expires_text)
    except ValueError:
        return None
    if prefix != "cb" or expires < (time.time() if now is None else now):
        return None
    if not any(
        hmac.compare_digest(mac, _mac(key, instance_id, expires)) for key in settings.CATACLOUD_BOOTSTRAP_KEYS
    ):
        return None
    return instance_id
