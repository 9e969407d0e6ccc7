"""Reads of the resources app."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from apps.core.ids import JobId
from apps.resources.choices import ResourceStatus
from apps.resources.models import ResourceInstance
from catacloud.agent.netns import Allow


def job_resources(*, job_id: JobId) -> tuple[list[str], list[str]]:
    """The resource types a job holds, and where those resources live (``host:port`` of a
    database, the API a token is for) as network allow entries, in one query: a job reaches
    what it holds even where its machine type's network refuses private or loopback addresses
    (a scratch database on the operator's LAN, the API on `make dev`'s loopback). Only
    addresses are allowed; a host name is left to the machine type's allow list (a rule holds
    for an address, not for what a name resolves to)."""
    types: list[str] = []
    entries: set[str] = set()
    rows = ResourceInstance.objects.filter(job_id=job_id).values_list(
        "resource_type_id", "status", "metadata"
    )
    for type_id, status, metadata in rows:
        types.append(type_id)
        if status in (ResourceStatus.READY, ResourceStatus.HELD):
            entries.update(_endpoints(metadata or {}))
    return types, sorted(entries)


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
