"""Cloud drivers behind one small interface, registered by dotted path and loaded on first use.

``build_provider("hetzner", config=..., credentials=...)`` imports ``hcloud`` only when a Hetzner
account is actually used, so processes never pay for SDKs they do not need.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from catacloud.providers.base import (
    LABEL_INSTALLATION,
    LABEL_INSTANCE,
    LABEL_ORG,
    LABEL_POOL,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Offering,
    OfferingProblem,
    Permanent,
    Provider,
    ProviderError,
    ProviderMachine,
    QuotaExceeded,
    RateLimited,
    Transient,
    machine_name,
)

__all__ = [
    "DRIVERS",
    "LABEL_INSTALLATION",
    "LABEL_INSTANCE",
    "LABEL_ORG",
    "LABEL_POOL",
    "InsufficientCapacity",
    "MachineSpec",
    "MachineState",
    "NotFound",
    "Offering",
    "OfferingProblem",
    "Permanent",
    "Provider",
    "ProviderError",
    "ProviderMachine",
    "QuotaExceeded",
    "RateLimited",
    "Transient",
    "build_provider",
    "get_driver_class",
    "machine_name",
]

# kind -> dotted path of the driver class (healthchecks' TRANSPORTS pattern).
DRIVERS: dict[str, str] = {
    "local": "catacloud.providers.local.LocalProvider",
    "hetzner": "catacloud.providers.hetzner.HetznerProvider",
    "aws": "catacloud.providers.aws.AwsProvider",
    "azure": "catacloud.providers.azure.AzureProvider",
    "fake": "catacloud.providers.fake.FakeProvider",
}


def get_driver_class(kind: str) -> type[Provider]:
    """Import and return the driver class for ``kind``; ``ValueError`` for unknown kinds."""
    from catacloud.plugins import load_plugin  # (the server's: an enrolled host needs no registry)

    return load_plugin(DRIVERS, kind, Provider, "provider kind", unknown=ValueError)


def build_provider(kind: str, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> Provider:
    """Instantiate the driver for one configured provider account."""
    return get_driver_class(kind)(config=config, credentials=credentials)
