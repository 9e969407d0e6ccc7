"""The provider interface: what every cloud driver implements.

Kept deliberately small (like Karpenter's CloudProvider or libcloud's NodeDriver):
``create``, ``get``, ``list`` by owner labels and an idempotent ``delete``. Drivers know
nothing of Django: services hand them a :class:`MachineSpec` and record what comes back.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

# Label keys every machine carries. Hetzner labels and EC2 tags use the same keys.
LABEL_INSTANCE = "catacloud/instance"
LABEL_POOL = "catacloud/pool"
LABEL_ORG = "catacloud/org"
LABEL_INSTALLATION = "catacloud/installation"


class MachineState(enum.StrEnum):
    """Provider-neutral machine states; each driver maps its own states onto these."""

    PROVISIONING = "provisioning"  # being created / booting
    RUNNING = "running"
    STOPPING = "stopping"  # on its way out
    GONE = "gone"  # deleted or terminated at the provider
    ERROR = "error"
    UNKNOWN = "unknown"


# ---- typed errors ---------------------------------------------------------------------------


class ProviderError(Exception):
    """Base of every error a driver raises. ``retryable`` tells tasks whether to back off."""

    retryable: ClassVar[bool] = False
    code: ClassVar[str] = "provider_error"

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message or self.code)
        self.retry_after = retry_after


class NotFound(ProviderError):
    code = "not_found"


class InsufficientCapacity(ProviderError):
    """The provider has no capacity for this type/location now. Try later or elsewhere."""

    retryable = True
    code = "insufficient_capacity"


class QuotaExceeded(ProviderError):
    """The account's limit at the provider is reached. Not retried automatically."""

    code = "quota_exceeded"


class RateLimited(ProviderError):
    retryable = True
    code = "rate_limited"


class Transient(ProviderError):
    """Network trouble, 5xx, timeouts: retry with backoff."""

    retryable = True
    code = "transient"


class Permanent(ProviderError):
    """Bad request, invalid image/type, authentication failure: retrying will not help."""

    code = "permanent"


# ---- values ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """How a new machine's agent finds the control plane: the same for every provider. Each
    driver turns it into what its machines run (cloud-init user data, a local process)."""

    agent_url: str
    token: str  # single-use; the agent exchanges it for its own credentials when it enrolls
    # What cloud machines pip-install: the agent wheel the control plane serves, pinned by its
    # sha256 (``<agent url>/api/agent/v1/dist/<wheel>#sha256=<digest>``); empty when it serves
    # none, and then no cloud machine can be made (local machines run the agent in place).
    package: str = ""

    def user_data(
        self, *, disk_gb: int | None = None, spot_notices: str = "", containers: bool = False
    ) -> str:
        """``spot_notices``: whose interruption notices the agent watches on a spot machine
        (``ec2``, ``azure``; empty: none); ``containers``: the machine installs the jobs' engine."""
        from catacloud.providers.userdata import render_user_data

        if not self.package:
            raise Permanent(
                "the control plane serves no agent wheel (CATACLOUD_AGENT_WHEEL is unset or holds no "
                "catacloud_agent wheel): a cloud machine installs its agent only from there"
            )
        return render_user_data(
            agent_url=self.agent_url,
            bootstrap_token=self.token,
            package=self.package,
            disk_gb=disk_gb,
            spot_notices=spot_notices,
            containers=containers,
        )

    def local_command(self) -> tuple[str, ...]:
        return (sys.executable, "-m", "catacloud.agent", "agent", "--url", self.agent_url)


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    """Everything a driver needs to create one machine.

    ``instance_id`` is the UUID of the MachineInstance row, committed before any cloud
    call; drivers derive their idempotency key from it (Hetzner: server name
    ``cc-<uuid>``; EC2: ``ClientToken``).
    """

    instance_id: str
    labels: Mapping[str, str]
    server_type: str
    image: str
    location: str = ""
    cpus: int = 1
    memory_mb: int = 1024
    gpus: int = 0
    spot: bool = False
    # The machine type's disk_gb: its jobs write to a file system of this size (None: no limit).
    disk_gb: int | None = None
    # The machine type's containers: its jobs get a container engine (the machine installs Podman).
    containers: bool = False
    bootstrap: Bootstrap | None = None
    # Explicit overrides of what ``bootstrap`` derives (tests and drivers' own uses): cloud
    # user data, and the local driver's command line and environment.
    user_data: str = ""
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return machine_name(self.instance_id)

    @property
    def cloud_init(self) -> str:
        """The user data a cloud machine boots with (its agent watching no interruption notices)."""
        return self.cloud_init_for("")

    def cloud_init_for(self, spot_notices: str) -> str:
        """The user data a cloud machine of a provider whose spot interruption notices come as
        ``spot_notices`` says (:attr:`Provider.spot_notices`) boots with: a spot machine's agent
        watches them, an on-demand machine's does not."""
        if self.user_data or self.bootstrap is None:
            return self.user_data
        return self.bootstrap.user_data(
            disk_gb=self.disk_gb, spot_notices=spot_notices if self.spot else "", containers=self.containers
        )

    @property
    def local_command(self) -> tuple[str, ...]:
        if self.command or self.bootstrap is None:
            return self.command
        return self.bootstrap.local_command()

    @property
    def local_env(self) -> Mapping[str, str]:
        if self.bootstrap is None:
            return self.env
        return {"CATACLOUD_BOOTSTRAP_TOKEN": self.bootstrap.token, **self.env}


@dataclasses.dataclass(frozen=True)
class Offering:
    """What a machine type asks its provider for: checked against the provider's own lists
    before a catalog names it (:meth:`Provider.check_offerings`)."""

    server_type: str
    image: str
    location: str = ""  # empty: the account's default (or the provider's choice)
    arch: str = ""  # what the machine type says its machines are (x86_64, arm64); empty: unchecked


@dataclasses.dataclass(frozen=True)
class OfferingProblem:
    """One thing wrong with an offering: ``refused`` (the provider would refuse every machine
    of it) or a warning (deprecated but still sold, sold out right now)."""

    offering: Offering
    message: str
    refused: bool = True


def machine_name(instance_id: str) -> str:
    return f"cc-{instance_id}"


@dataclasses.dataclass(frozen=True)
class ProviderMachine:
    """What a provider tells us about one machine."""

    provider_id: str
    name: str
    state: MachineState
    labels: Mapping[str, str]
    created_at: datetime | None = None
    public_ip: str = ""
    private_ip: str = ""
    raw_state: str = ""

    @property
    def instance_id(self) -> str | None:
        return self.labels.get(LABEL_INSTANCE)

    @property
    def alive(self) -> bool:
        return self.state not in (MachineState.GONE, MachineState.STOPPING)


# ---- the interface --------------------------------------------------------------------------


class Provider(abc.ABC):
    """One configured account at one provider."""

    kind: ClassVar[str]
    # Drivers that keep files on this host (the local one) get a ``state_dir`` in their config,
    # under CATACLOUD_HOME, unless the account sets one.
    needs_state_dir: ClassVar[bool] = False
    # provider raw state -> MachineState; one table per driver.
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = {}
    # Drivers that buy machines from a price list check a catalog's server types, images and
    # locations against it (``check_offerings``); the others have nothing to check.
    checks_offerings: ClassVar[bool] = False
    # Where a spot machine's agent reads interruption notices: "ec2" (the instance metadata
    # service's spot/instance-action) or "azure" (Scheduled Events); empty: the provider has none.
    spot_notices: ClassVar[str] = ""

    def __init__(self, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> None:
        self.config = dict(config)
        self.credentials = dict(credentials)

    @classmethod
    def map_state(cls, raw: str) -> MachineState:
        return cls.STATE_MAP.get(raw, MachineState.UNKNOWN)

    @abc.abstractmethod
    def create(self, spec: MachineSpec) -> ProviderMachine:
        """Create the machine, or adopt the one that already carries this spec's identity."""

    @abc.abstractmethod
    def get(self, provider_id: str) -> ProviderMachine:
        """Raise :class:`NotFound` when the machine does not exist (any more)."""

    @abc.abstractmethod
    def list(self, owner_labels: Mapping[str, str]) -> list[ProviderMachine]:
        """Every live-or-dying machine carrying all ``owner_labels``."""

    @abc.abstractmethod
    def delete(self, provider_id: str) -> None:
        """Destroy the machine. Idempotent: a machine that is already gone is success."""

    def check_offerings(self, offerings: Sequence[Offering]) -> Sequence[OfferingProblem]:
        """What is wrong with each offering, by the provider's own lists: one list call for each
        kind (server types, images, locations), never one per offering. Raises the typed errors
        of any call (a wrong credential, the API unreachable)."""
        return ()

    def check_credentials(self) -> None:
        """One cheap read call the account's credentials and settings must pass (an
        organization's own account is checked with it before it is stored). Raises the typed
        errors, with the provider's own message. Default: list this installation's machines."""
        self.list({LABEL_INSTALLATION: "credential-check"})

    def find_by_instance(self, instance_id: str, owner_labels: Mapping[str, str]) -> ProviderMachine | None:
        """Find the machine labelled with ``instance_id`` (used to adopt after a crash)."""
        labels = {**owner_labels, LABEL_INSTANCE: instance_id}
        found = [m for m in self.list(labels) if m.alive]
        return found[0] if found else None
