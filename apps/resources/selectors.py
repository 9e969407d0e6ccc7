"""Reads of the resources app."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from apps.core.ids import JobId
from apps.resources.choices import ResourceStatus
from apps.resources.models import ResourceInstance
from catacloud.agent.netns import Allow


def resource_endpoints(*, job_id: JobId) -> list[str]:
    """Where the resources a job holds live (``host:port`` of a database, the API a token is
    for), as network allow entries: a job reaches what it holds even where its machine type's
    network refuses private or loopback addresses (a scratch database on the operator's LAN,
    the API on `make dev`'s loopback). Only addresses are allowed; a host name is left to the
    machine type's allow list (a rule holds for an address, not for what a name resolves to)."""
    entries: list[str] = []
    held = ResourceInstance.objects.filter(
        job_id=job_id, status__in=(ResourceStatus.READY, ResourceStatus.HELD)
    ).values_list("metadata", flat=True)
    for metadata in held:
        entries += _endpoints(metadata or {})
    return sorted(set(entries))


def _endpoints(metadata: dict[str, Any]) -> list[str]:
    found: list[tuple[str, int]] = []
    if metadata.get("host") and str(metadata.get("port", "")).isdigit():
        found.append((str(metadata["host"]), int(metadata["port"])))
    for key, value in metadata.items():
        if key.endswith("url") and isinstance(value, str) and "://" in value:
            parts = urlsplit(value)
            default = {"https": 443, "http": 80}.get(parts.scheme)
            try:
                port = parts.port or default
            except ValueError:
                continue
            if parts.hostname and port:
                found.append((parts.hostname, port))
    entries = []
    for host, port in found:
        try:
            address = "127.0.0.1" if host == "localhost" else str(ipaddress.ip_address(host))
            entry = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
            entries.append(str(Allow.parse(entry)))
        except ValueError:
            continue  # a name, or not an address
    return entries
