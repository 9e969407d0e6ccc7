"""Microsoft Azure Virtual Machines driver on Microsoft's SDK: azure-identity (a service
principal's client secret) and azure-mgmt-compute.

Config: ``subscription_id``, ``resource_group`` (where machines are made; it must exist),
``location`` (the region for specs without one), ``subnet_id`` (the full ARM id of the subnet the
machines' NICs join), ``public_ip`` (default true, see below), optional ``admin_username``
(default ``catacloud``), ``ssh_public_key`` (an ``ssh-rsa`` key of at least 2048 bits, for
break-glass access), ``os_disk_type`` (default ``StandardSSD_LRS``), ``os_disk_gb`` (default: the
image's, 30 GB for Ubuntu), ``endpoint`` (the ARM base URL, default https://management.azure.com),
``token_scope`` (default ``<endpoint>/.default``), ``authority`` (the login host, default
login.microsoftonline.com), ``connection_verify`` (a CA bundle's path), ``connect_timeout`` /
``read_timeout`` (s, default 10 / 60), ``max_attempts`` (total attempts per call, 1 = no retry;
azure-core retries 408, 429, 5xx and connection errors with exponential backoff from
``retry_backoff`` s, default 0.8, honouring Retry-After; default 4), ``poll_interval`` (s between
looks at a create's operation, default 5), ``create_timeout`` (s a create waits for it, default
300: under the provision task's time limit, CELERY_TASK_SOFT_TIME_LIMIT, 540 s by default).
Credentials: ``tenant_id``, ``client_id``, ``client_secret`` (a service principal's secret).
Its role on the resource group needs Microsoft.Compute/virtualMachines/{read,write,delete},
Microsoft.Compute/disks/{read,write,delete}, Microsoft.Network/networkInterfaces/{read,write,
delete,join/action}, Microsoft.Network/publicIPAddresses/{read,write,delete,join/action}; on the
subnet Microsoft.Network/virtualNetworks/subnets/join/action; on the subscription
Microsoft.Compute/skus/read and Microsoft.Compute/locations/* reads (operations, images), as
Virtual Machine Contributor plus Network Contributor on the group and a reader role do.

``public_ip``: since 2025-09-30 Azure retires default outbound access (new virtual networks'
subnets are private), so a VM with neither a public IP nor a NAT gateway (or load balancer
outbound rule) on its subnet reaches nothing outside its network, and its agent never reaches the
control plane (https://learn.microsoft.com/azure/virtual-network/ip-services/default-outbound-access).
Set it false only on a subnet with a NAT gateway. The public IP is a Standard one: closed to
inbound traffic unless a network security group opens it, open outbound.

Linux VMs need an admin user, and with password authentication off (always, here) an SSH key:
without ``ssh_public_key`` the driver makes one of its own and throws the private half away, so
nobody can log in (Azure accepts only ``ssh-rsa`` keys, SshPublicKey.keyData).

Each machine is one VM named ``cc-<instance uuid>`` whose NIC, public IP and OS disk are made with
it (``networkProfile.networkInterfaceConfigurations``, ``networkApiVersion`` 2020-11-01) and
deleted with it (``deleteOption: Delete``; the default, Detach, would leave them billing,
https://learn.microsoft.com/azure/virtual-machines/delete). The provider id is the VM's name (its
ARM id is longer than the instance row keeps); names are unique in the resource group, and a PUT
is create-or-update, so a create is idempotent: before creating, the driver adopts the VM of that
name when it carries this instance's tag, and a create that finds one being made (a retried PUT
whose answer was lost) adopts it too.

Azure reports capacity only at the end of a create: an allocation failure (AllocationFailed,
ZonalAllocationFailed) is the error of the create's long-running operation, not of the PUT. So
``create`` follows the operation (Azure-AsyncOperation) for up to ``create_timeout`` s, as Hetzner's
driver waits for its action: only an InsufficientCapacity raised by ``create`` makes a machine
type cool down. A VM whose create failed is deleted before the error is raised; one still being
made after ``create_timeout`` is returned as provisioning.

Tags: Azure tag names may not contain ``< > % & \\ ? /``
(https://learn.microsoft.com/azure/azure-resource-manager/management/tag-resources#limitations),
so a label ``catacloud/instance`` is the tag ``catacloud:instance``; label keys may not contain
``:`` (it could not be read back).

Spot machines are ``priority: Spot`` with ``evictionPolicy: Delete`` and ``maxPrice: -1`` (never
evicted for price, never charged above the pay-as-you-go price); Azure announces an eviction
through Scheduled Events at least 30 s ahead, which their agent watches (``--imds-kind azure``).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar, cast

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.rest import HttpRequest, HttpResponse
from azure.identity import ClientSecretCredential
from azure.mgmt.compute import ComputeManagementClient
from azure.mgmt.core.policies import ARMHttpLoggingPolicy

from catacloud.providers.base import (
    LABEL_INSTANCE,
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
)

T = TypeVar("T")

# ARM error code -> our typed error. Sources: common deployment errors
# (https://learn.microsoft.com/azure/azure-resource-manager/troubleshooting/common-deployment-errors),
# allocation failures (https://learn.microsoft.com/troubleshoot/azure/virtual-machines/allocation-failure,
# https://learn.microsoft.com/troubleshoot/azure/azure-kubernetes/error-codes/zonalallocation-allocationfailed-error),
# Spot (https://learn.microsoft.com/azure/virtual-machines/error-codes-spot: no Spot capacity is
# SkuNotAvailable), quota (.../troubleshooting/error-resource-quota). OperationNotAllowed is
# decided by its message (see map_error), a 429 always means throttling.
ERROR_CODES: Mapping[str, type[ProviderError]] = {
    "SkuNotAvailable": InsufficientCapacity,
    "AllocationFailed": InsufficientCapacity,
    "ZonalAllocationFailed": InsufficientCapacity,
    "OverconstrainedAllocationRequest": InsufficientCapacity,
    "OverconstrainedZonalAllocationRequest": InsufficientCapacity,
    "SpotPriceGreaterThanProvidedMaxPrice": InsufficientCapacity,
    "QuotaExceeded": QuotaExceeded,
    "ResourceQuotaExceeded": QuotaExceeded,
    "PublicIPCountLimitReached": QuotaExceeded,
    "TooManyRequests": RateLimited,
    "AnotherOperationInProgress": Transient,
    "OperationPreempted": Transient,
    "InternalServerError": Transient,
    "InternalExecutionError": Transient,
    "ServiceUnavailable": Transient,
    "GatewayTimeout": Transient,
    "RetryableError": Transient,
    "ResourceNotFound": NotFound,
    "NotFound": NotFound,
    # Not found, but what is missing is the account's own setup: retrying will not help.
    "ResourceGroupNotFound": Permanent,
    "SubscriptionNotFound": Permanent,
    "PlatformImageNotFound": Permanent,
    "InvalidResourceReference": Permanent,
    "AuthorizationFailed": Permanent,
    "LinkedAuthorizationFailed": Permanent,
    "AuthenticationFailed": Permanent,
    "InvalidAuthenticationToken": Permanent,
    "ExpiredAuthenticationToken": Permanent,
    "InvalidParameter": Permanent,
}

# What a VM's raw state (see _raw_state) means. Provisioning states: Creating, Updating,
# Migrating, Succeeded, Failed, Deleting; power states: starting, running, stopping, stopped,
# deallocating, deallocated, unknown (https://learn.microsoft.com/azure/virtual-machines/states-billing).
_STATES: Mapping[str, MachineState] = {
    "creating": MachineState.PROVISIONING,
    "starting": MachineState.PROVISIONING,
    "running": MachineState.RUNNING,
    "migrating": MachineState.RUNNING,
    "stopping": MachineState.STOPPING,
    "stopped": MachineState.STOPPING,  # still billed; we never stop machines, so it is on its way out
    "deallocating": MachineState.STOPPING,
    "deallocated": MachineState.STOPPING,
    "deleting": MachineState.STOPPING,
    "failed": MachineState.ERROR,
    "unknown": MachineState.UNKNOWN,
}
_DONE = ("succeeded", "failed", "canceled")
# The API version of the Microsoft.Network reads (NICs and public IPs, for the machines' addresses).
NETWORK_API_VERSION = "2024-05-01"
_ARCH = {"x64": "x86_64", "arm64": "arm64"}
# Label keys: letters, digits, '.', '_', '-' and '/' (the prefix separator), never ':' (it encodes '/').
_LABEL_KEY = re.compile(r"^[A-Za-z0-9._/-]{1,512}$")
_VM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}[A-Za-z0-9_]$")
_CUSTOM_DATA_MAX = 65535  # bytes, decoded (OSProfile.customData: 87380 base64 characters)
# azure-core logs every request and answer at INFO; ours are quiet unless an operator lowers this.
HTTP_LOG = logging.getLogger("catacloud.providers.azure.http")
HTTP_LOG.setLevel(logging.WARNING)


def tag_name(label: str) -> str:
    """The Azure tag name of a label key: ``catacloud/instance`` -> ``catacloud:instance``."""
    if not _LABEL_KEY.match(label):
        raise Permanent(f"azure: label key {label!r} cannot be a tag name (letters, digits, . _ - / only)")
    return label.replace("/", ":")


def label_key(tag: str) -> str:
    return tag.replace(":", "/")


def map_error(exc: BaseException) -> ProviderError:
    """Translate an azure-core / azure-identity exception into the provider error hierarchy."""
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, ClientAuthenticationError) and exc.response is None:
        # The credential could not get a token: unreachable login host (transient) or refused.
        if _caused_by_transport(exc):
            return Transient(f"azure: {_first_line(exc)}")
        return Permanent(f"azure: {_first_line(exc)}")
    if isinstance(exc, HttpResponseError):
        status = exc.status_code or 0
        code = _code(exc)
        message = exc.error.message if exc.error is not None and exc.error.message else _first_line(exc)
        retry_after = _retry_after(getattr(exc.response, "headers", None) or {})
        return from_code(code, message, status=status, retry_after=retry_after)
    if isinstance(exc, ServiceRequestError | ServiceResponseError):
        return Transient(f"azure: {type(exc).__name__}: {_first_line(exc)}")
    return Permanent(f"azure: unexpected {type(exc).__name__}: {exc}")


def from_code(code: str, message: str, *, status: int = 0, retry_after: float | None = None) -> ProviderError:
    """The typed error for an ARM error code (and the HTTP status it came with, if any)."""
    text = f"azure: {code}: {message}" if code else f"azure: {message}"
    if status == 429:
        return RateLimited(text, retry_after=retry_after)
    cls = ERROR_CODES.get(code)
    if cls is None and code == "OperationNotAllowed":
        # The Compute RP's catch-all: a quota ("... exceeding approved Total Regional Cores quota"),
        # a VM being deleted ("... since the VM is marked for deletion"), or a refusal.
        lowered = message.lower()
        cls = (
            QuotaExceeded
            if "quota" in lowered
            else Transient
            if "marked for deletion" in lowered
            else Permanent
        )
    if cls is None:
        cls = NotFound if status == 404 else Transient if status >= 500 or status == 408 else Permanent
    return cls(text, retry_after=retry_after if cls is RateLimited else None)


def _code(exc: HttpResponseError) -> str:
    return exc.error.code if exc.error is not None and exc.error.code else ""


def _caused_by_transport(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ServiceRequestError | ServiceResponseError | ConnectionError | TimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers["Retry-After"])
    except (KeyError, ValueError):
        return None


@functools.lru_cache(maxsize=32)
def _credential(
    tenant_id: str, client_id: str, client_secret: str, authority: str, options: tuple[tuple[str, Any], ...]
) -> ClientSecretCredential:
    """One credential per service principal, login host and transport options in a process: it
    keeps its token (an hour's) and renews it before it expires, so building a provider for each
    task costs no login."""
    return ClientSecretCredential(
        tenant_id,
        client_id,
        client_secret,
        # MSAL validates an authority it does not know by asking login.microsoftonline.com
        # (instance discovery); one configured here is trusted as given.
        authority=authority or None,
        disable_instance_discovery=True if authority else None,
        **dict(options),
    )


@functools.cache
def throwaway_ssh_key() -> str:
    """An ``ssh-rsa`` public key whose private half nobody keeps: the VM needs one (password
    logins are off), and nobody can log in with it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return public.decode() + " catacloud-no-login"


def image_reference(image: str) -> dict[str, str]:
    """``spec.image`` as the VM's imageReference: a marketplace URN ``publisher:offer:sku:version``
    or an image's resource id (a managed image, a gallery's image version, a shared or community
    gallery image)."""
    if image.startswith("/CommunityGalleries/"):
        return {"communityGalleryImageId": image}
    if image.startswith("/SharedGalleries/"):
        return {"sharedGalleryImageId": image}
    if image.startswith("/subscriptions/"):
        return {"id": image}
    parts = image.split(":")
    if len(parts) != 4 or not all(parts):
        raise Permanent(
            f"azure: image {image!r} is neither publisher:offer:sku:version "
            "(e.g. Canonical:ubuntu-24_04-lts:server:latest) nor an image resource id"
        )
    return dict(zip(("publisher", "offer", "sku", "version"), parts, strict=True))


class AzureProvider(Provider):
    kind = "azure"
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = _STATES
    checks_offerings = True
    spot_notices = "azure"

    def __init__(self, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> None:
        super().__init__(config=config, credentials=credentials)
        cfg = self.config
        missing = [
            k for k in ("subscription_id", "resource_group", "location", "subnet_id") if not cfg.get(k)
        ]
        if missing:
            raise Permanent(f"azure provider needs config {', '.join(map(repr, missing))}")
        secrets = [k for k in ("tenant_id", "client_id", "client_secret") if not self.credentials.get(k)]
        if secrets:
            raise Permanent(f"azure provider needs credentials {', '.join(map(repr, secrets))}")
        self.subscription_id = str(cfg["subscription_id"])
        self.resource_group = str(cfg["resource_group"])
        self.location = str(cfg["location"])
        self.subnet_id = str(cfg["subnet_id"])
        self.public_ip = bool(cfg.get("public_ip", True))
        self.admin_username = str(cfg.get("admin_username") or "catacloud")
        self.ssh_public_key = str(cfg.get("ssh_public_key") or "")
        if self.ssh_public_key and not self.ssh_public_key.startswith("ssh-rsa "):
            raise Permanent("azure: ssh_public_key must be an ssh-rsa key (Azure accepts no other kind)")
        self.os_disk_type = str(cfg.get("os_disk_type") or "StandardSSD_LRS")
        self.os_disk_gb = int(cfg["os_disk_gb"]) if cfg.get("os_disk_gb") else None
        self.poll_interval = float(cfg.get("poll_interval", 5.0))
        self.create_timeout = float(cfg.get("create_timeout", 300.0))
        self.endpoint = str(cfg.get("endpoint") or "https://management.azure.com").rstrip("/")
        self.client = self._client()

    def _client(self) -> ComputeManagementClient:
        cfg, creds = self.config, self.credentials
        common: dict[str, Any] = {
            "connection_timeout": float(cfg.get("connect_timeout", 10)),
            "read_timeout": float(cfg.get("read_timeout", 60)),
            "retry_total": max(0, int(cfg.get("max_attempts", 4)) - 1),
            "retry_backoff_factor": float(cfg.get("retry_backoff", 0.8)),
            "retry_backoff_max": float(cfg.get("retry_max_delay", 30)),
        }
        if cfg.get("connection_verify"):
            common["connection_verify"] = str(cfg["connection_verify"])
        credential = _credential(
            creds["tenant_id"],
            creds["client_id"],
            creds["client_secret"],
            str(cfg.get("authority") or ""),
            tuple(sorted(common.items())),
        )
        return ComputeManagementClient(
            credential,
            self.subscription_id,
            base_url=self.endpoint,
            credential_scopes=[str(cfg.get("token_scope") or f"{self.endpoint}/.default")],
            user_agent="catacloud",
            http_logging_policy=ARMHttpLoggingPolicy(logger=HTTP_LOG),
            **common,
        )

    # ---- the interface ------------------------------------------------------------------------

    def create(self, spec: MachineSpec) -> ProviderMachine:
        name = spec.name
        body = self._vm_body(spec)  # a spec Azure would refuse fails here, before any call
        existing = self._call(lambda: self._find(name))
        if existing is not None:
            return self._adopt(spec, existing)
        try:
            async_url = self._put(name, body)
        except Exception as exc:
            error = map_error(exc)
            if not (isinstance(exc, HttpResponseError) and _code(exc) == "AnotherOperationInProgress"):
                raise error from exc
            # A create of this name is under way: ours, whose answer was lost (a retried PUT).
            found = self._call(lambda: self._find(name))
            if found is None:
                raise error from exc
            return self._adopt(spec, found)
        return self._settle(name, async_url)

    def get(self, provider_id: str) -> ProviderMachine:
        name = self._name_of(provider_id)
        if name is None:
            raise NotFound(f"azure: no VM {provider_id!r}")
        vm = self._call(lambda: self._get_vm(name))
        return self._machine(vm, self._call(self._addresses))

    def list(self, owner_labels: Mapping[str, str]) -> builtins.list[ProviderMachine]:
        wanted = {tag_name(k).lower(): v for k, v in owner_labels.items()}
        vms = self._call(lambda: self._all_vms())
        ours = [vm for vm in vms if wanted.items() <= _tags(vm).items()]
        if not ours:
            return []
        addresses = self._call(self._addresses)
        return [self._machine(vm, addresses) for vm in ours]

    def delete(self, provider_id: str) -> None:
        """Ask for the VM's deletion (its disk, NIC and IP go with it) and return: a delete takes a
        minute or so, and the VM shows as stopping meanwhile. 204, nothing there, is success."""
        name = self._name_of(provider_id)
        if name is None:
            return  # not one of our VM names: nothing there to delete
        try:
            self._call(
                lambda: self.client.virtual_machines.begin_delete(self.resource_group, name, polling=False)
            )
        except NotFound:
            return

    def check_credentials(self) -> None:
        """One cheap read with the account's credentials: the first page of the resource group's
        VMs. Raises the typed error of a wrong secret, tenant, subscription, resource group or a
        role that may not read VMs."""

        def first_page() -> None:
            pages = self.client.virtual_machines.list(self.resource_group).by_page()
            builtins.list(next(iter(pages), []))

        self._call(first_page)

    def check_offerings(self, offerings: Sequence[Offering]) -> Sequence[OfferingProblem]:
        """Each offering against the region's resource SKUs (one ``resource_skus.list`` per
        location, filtered to it): the size must be offered and not restricted for this
        subscription, and be of the offering's architecture; a marketplace image must have a
        version there (one list per image) that the size's processor runs (one get)."""
        catalog = _Catalog(self)
        return [p for o in offerings for p in catalog.problems(o, o.location or self.location)]

    # ---- calls ------------------------------------------------------------------------------------

    @staticmethod
    def _call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ProviderError:
            raise
        except Exception as exc:
            raise map_error(exc) from exc

    def _find(self, name: str) -> dict[str, Any] | None:
        try:
            return self._get_vm(name)
        except HttpResponseError as exc:
            if isinstance(map_error(exc), NotFound):
                return None
            raise

    def _get_vm(self, name: str) -> dict[str, Any]:
        vm = self.client.virtual_machines.get(self.resource_group, name, expand="instanceView")
        return _json(vm)

    def _all_vms(self) -> builtins.list[dict[str, Any]]:
        return [
            _json(vm) for vm in self.client.virtual_machines.list(self.resource_group, expand="instanceView")
        ]

    def _put(self, name: str, body: dict[str, Any]) -> str:
        """PUT the VM; the answer's Azure-AsyncOperation URL (the create's operation)."""
        poller = self.client.virtual_machines.begin_create_or_update(
            self.resource_group,
            name,
            cast(Any, body),
            polling=False,
            cls=lambda pipeline_response, deserialized, headers: pipeline_response.http_response,
        )
        response = cast(HttpResponse, poller.result())
        return str(response.headers.get("Azure-AsyncOperation") or "")

    def _arm_get(self, url: str) -> dict[str, Any]:
        response = self.client.send_request(HttpRequest("GET", url))
        if response.status_code >= 400:
            raise HttpResponseError(response=response)
        return cast(dict[str, Any], response.json())

    def _arm_list(self, path: str, api_version: str) -> Iterator[dict[str, Any]]:
        url: str | None = f"{self.endpoint}{path}?api-version={api_version}"
        while url:
            page = self._arm_get(url)
            yield from page.get("value") or []
            url = page.get("nextLink")

    def _addresses(self) -> dict[str, tuple[str, str]]:
        """VM name (lower-case) -> (public IP, private IP), from the resource group's NIC and public
        IP lists (two reads, however many VMs)."""
        group = f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}"
        base = f"{group}/providers/Microsoft.Network"
        ips = {
            ip["id"].lower(): (ip.get("properties") or {}).get("ipAddress", "")
            for ip in self._arm_list(f"{base}/publicIPAddresses", NETWORK_API_VERSION)
        }
        found: dict[str, tuple[str, str]] = {}
        for nic in self._arm_list(f"{base}/networkInterfaces", NETWORK_API_VERSION):
            props = nic.get("properties") or {}
            owner = (props.get("virtualMachine") or {}).get("id", "")
            configs = props.get("ipConfigurations") or [{}]
            ip = configs[0].get("properties") or {}
            public = ips.get(((ip.get("publicIPAddress") or {}).get("id") or "").lower(), "")
            if owner:
                found[owner.rsplit("/", 1)[-1].lower()] = (public, ip.get("privateIPAddress", ""))
        return found

    # ---- create: the body, then waiting for the operation ---------------------------------------

    def _vm_body(self, spec: MachineSpec) -> dict[str, Any]:
        name = spec.name
        if not _VM_NAME.match(name):
            raise Permanent(f"azure: {name!r} is not a valid VM name")
        if spec.labels.get(LABEL_INSTANCE, spec.instance_id) != spec.instance_id:
            raise Permanent(f"label {LABEL_INSTANCE} disagrees with the spec's instance id")
        labels = {**spec.labels, LABEL_INSTANCE: spec.instance_id}
        properties: dict[str, Any] = {
            "hardwareProfile": {"vmSize": spec.server_type},
            "storageProfile": self._storage(spec),
            "osProfile": self._os_profile(spec),
            "networkProfile": self._network(name),
        }
        if spec.spot:
            properties.update(priority="Spot", evictionPolicy="Delete", billingProfile={"maxPrice": -1})
        too_long = [k for k, v in labels.items() if len(v) > 256]  # a tag value holds 256 characters
        if too_long:
            raise Permanent(f"azure: the values of labels {', '.join(too_long)} are longer than a tag's 256")
        return {
            "location": spec.location or self.location,
            "tags": {tag_name(k): v for k, v in labels.items()},
            "properties": properties,
        }

    def _storage(self, spec: MachineSpec) -> dict[str, Any]:
        os_disk: dict[str, Any] = {
            "name": f"{spec.name}-osdisk",
            "createOption": "FromImage",
            "deleteOption": "Delete",
            "managedDisk": {"storageAccountType": self.os_disk_type},
        }
        if self.os_disk_gb:
            os_disk["diskSizeGB"] = self.os_disk_gb
        return {"imageReference": image_reference(spec.image), "osDisk": os_disk}

    def _os_profile(self, spec: MachineSpec) -> dict[str, Any]:
        key = self.ssh_public_key or throwaway_ssh_key()
        profile: dict[str, Any] = {
            "computerName": spec.name,
            "adminUsername": self.admin_username,
            "linuxConfiguration": {
                "disablePasswordAuthentication": True,
                "ssh": {
                    "publicKeys": [
                        {"path": f"/home/{self.admin_username}/.ssh/authorized_keys", "keyData": key}
                    ]
                },
            },
        }
        # cloud-init reads the custom data on Azure (not userData): the agent's user data, spot
        # machines' with their agent watching Scheduled Events.
        if user_data := spec.cloud_init_for(self.spot_notices):
            raw = user_data.encode()
            if len(raw) > _CUSTOM_DATA_MAX:
                raise Permanent(
                    f"azure: user data is {len(raw)} bytes; custom data holds at most {_CUSTOM_DATA_MAX}"
                )
            profile["customData"] = base64.b64encode(raw).decode()
        return profile

    def _network(self, name: str) -> dict[str, Any]:
        ip_config: dict[str, Any] = {"primary": True, "subnet": {"id": self.subnet_id}}
        if self.public_ip:
            ip_config["publicIPAddressConfiguration"] = {
                "name": f"{name}-ip",
                "sku": {"name": "Standard", "tier": "Regional"},
                "properties": {"deleteOption": "Delete", "publicIPAllocationMethod": "Static"},
            }
        return {
            "networkApiVersion": "2020-11-01",
            "networkInterfaceConfigurations": [
                {
                    "name": f"{name}-nic",
                    "properties": {
                        "primary": True,
                        "deleteOption": "Delete",
                        "ipConfigurations": [{"name": "ipconfig1", "properties": ip_config}],
                    },
                }
            ],
        }

    def _adopt(self, spec: MachineSpec, vm: dict[str, Any]) -> ProviderMachine:
        """Take over the VM of this spec's name, made by an earlier attempt (perhaps one whose
        answer was lost): wait for it like a fresh create; never hand out a broken one."""
        if _tags(vm).get(tag_name(LABEL_INSTANCE)) != spec.instance_id:
            raise Permanent(f"azure: VM name {spec.name} is taken by a VM that is not ours")
        raw = _raw_state(vm)
        if raw in ("failed", "deleting", "stopped", "deallocated", "deallocating", "stopping"):
            if raw != "deleting":  # left over by a failed or evicted attempt: remove it, then retry
                with contextlib.suppress(ProviderError):  # else the reconciler removes it later
                    self.delete(spec.name)
            raise Transient(f"azure: {spec.name} is a leftover ({raw}); it is being deleted, retry")
        return self._settle(spec.name, "")

    def _settle(self, name: str, async_url: str) -> ProviderMachine:
        """Wait (up to ``create_timeout``) until the create is done: through its operation when we
        have its URL, else by the VM's provisioning state. A failed create's VM is deleted, and
        its error raised typed (AllocationFailed: InsufficientCapacity)."""
        deadline = time.monotonic() + self.create_timeout
        while True:
            if async_url:
                status, error = self._call(lambda: self._operation(async_url))
            else:
                vm = self._call(lambda: self._get_vm(name))
                status, error = _provisioning(vm)
            if status in _DONE or time.monotonic() >= deadline:
                break
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        if error is not None:
            with contextlib.suppress(ProviderError):  # else it stays, failed, until the reconciler removes it
                self.delete(name)
            raise from_code(error.get("code", ""), error.get("message", "the create failed"))
        vm = self._call(lambda: self._get_vm(name))
        return self._machine(vm, self._call(self._addresses))

    def _operation(self, url: str) -> tuple[str, dict[str, str] | None]:
        """The operation's status, lower-cased, and its error when it failed or was canceled."""
        body = self._arm_get(url)
        status = str(body.get("status", "")).lower()
        if status in ("failed", "canceled"):
            return status, dict(body.get("error") or {"code": "", "message": f"the create was {status}"})
        return status, None

    # ---- answers ----------------------------------------------------------------------------------

    def _name_of(self, provider_id: str) -> str | None:
        """Our provider id is the VM name; an ARM id of a VM in our resource group is accepted too."""
        name = provider_id
        if provider_id.startswith("/"):
            group = f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}"
            prefix = f"{group}/providers/Microsoft.Compute/virtualMachines/".lower()
            if not provider_id.lower().startswith(prefix):  # ARM ids are case-insensitive
                return None
            name = provider_id[len(prefix) :]
        return name if _VM_NAME.match(name) else None

    def _machine(self, vm: dict[str, Any], addresses: Mapping[str, tuple[str, str]]) -> ProviderMachine:
        raw = _raw_state(vm)
        props = vm.get("properties") or {}
        created = props.get("timeCreated")
        public, private = addresses.get(str(vm.get("name", "")).lower(), ("", ""))
        return ProviderMachine(
            provider_id=vm["name"],
            name=vm["name"],
            state=self.map_state(raw),
            labels={label_key(k): v for k, v in (vm.get("tags") or {}).items()},
            created_at=datetime.fromisoformat(created.replace("Z", "+00:00")) if created else None,
            public_ip=public,
            private_ip=private,
            raw_state=raw,
        )


def _json(model: Any) -> dict[str, Any]:
    """An SDK model as the REST JSON it came from (the field names of the API reference)."""
    return cast(dict[str, Any], model.as_dict())


def _tags(vm: Mapping[str, Any]) -> dict[str, str]:
    """A VM's tags by lower-cased name: tag names are case-insensitive at Azure (its casing of a
    name is kept, but a tag is found whatever the casing)."""
    return {str(k).lower(): str(v) for k, v in (vm.get("tags") or {}).items()}


def _statuses(vm: Mapping[str, Any]) -> builtins.list[dict[str, Any]]:
    return ((vm.get("properties") or {}).get("instanceView") or {}).get("statuses") or []


def _raw_state(vm: Mapping[str, Any]) -> str:
    """One word for a VM's state: its provisioning state while it is being deleted or failed,
    else its power state (``PowerState/running`` -> ``running``), else its provisioning state."""
    provisioning = str((vm.get("properties") or {}).get("provisioningState", "")).lower()
    if provisioning in ("deleting", "failed"):
        return provisioning
    power = [
        s["code"].split("/", 1)[1] for s in _statuses(vm) if str(s.get("code", "")).startswith("PowerState/")
    ]
    return power[0].lower() if power else provisioning or "unknown"


def _provisioning(vm: Mapping[str, Any]) -> tuple[str, dict[str, str] | None]:
    """A VM's provisioning state and, when it failed, the error of its instance view
    (``ProvisioningState/failed/<code>`` with the message)."""
    state = str((vm.get("properties") or {}).get("provisioningState", "")).lower()
    if state != "failed":
        return state, None
    for status in _statuses(vm):
        code = str(status.get("code", ""))
        if code.startswith("ProvisioningState/failed"):
            return state, {
                "code": code.split("/")[2] if code.count("/") >= 2 else "",
                "message": status.get("message", ""),
            }
    return state, {"code": "", "message": "the create failed"}


class _Catalog:
    """What one subscription may buy, read lazily (one SKU list per location, one version list
    and one get per marketplace image), and judged offering by offering."""

    def __init__(self, provider: AzureProvider) -> None:
        self.provider = provider
        self._skus: dict[str, dict[str, dict[str, Any]]] = {}
        self._images: dict[tuple[str, str], dict[str, Any] | None] = {}

    def skus(self, location: str) -> dict[str, dict[str, Any]]:
        if location not in self._skus:
            client = self.provider.client
            listed = self.provider._call(
                lambda: [_json(s) for s in client.resource_skus.list(filter=f"location eq '{location}'")]
            )
            self._skus[location] = {
                s["name"]: s for s in listed if s.get("resourceType") == "virtualMachines"
            }
        return self._skus[location]

    def image(self, location: str, image: str) -> dict[str, Any] | None:
        """The marketplace image's version to be used (the newest for ``latest``), with its
        architecture; ``None`` when there is none."""
        if (location, image) not in self._images:
            self._images[location, image] = self.provider._call(lambda: self._read_image(location, image))
        return self._images[location, image]

    def _read_image(self, location: str, image: str) -> dict[str, Any] | None:
        ref = image_reference(image)
        images = self.provider.client.virtual_machine_images
        args = (location, ref["publisher"], ref["offer"], ref["sku"])
        try:
            versions = [str(v.name) for v in images.list(*args)]
            if ref["version"] != "latest" and ref["version"] not in versions:
                return None
            if not versions:
                return None
            version = max(versions, key=_version_key) if ref["version"] == "latest" else ref["version"]
            return _json(images.get(*args, version))
        except HttpResponseError as exc:
            if isinstance(map_error(exc), NotFound):
                return None
            raise

    def problems(self, offering: Offering, location: str) -> builtins.list[OfferingProblem]:
        found: builtins.list[OfferingProblem] = []

        def say(message: str, refused: bool = True) -> None:
            found.append(OfferingProblem(offering, f"azure: {message}", refused))

        skus = self.skus(location)
        sku = skus.get(offering.server_type)
        if not skus:
            say(f"no VM sizes are offered at {location!r} to this subscription (is the location right?)")
            return found
        if sku is None:
            say(f"no VM size {offering.server_type!r} is offered at {location}")
        else:
            self._judge_size(sku, offering, location, say)
        self._judge_image(offering, location, sku, say)
        return found

    @staticmethod
    def _judge_size(
        sku: Mapping[str, Any], offering: Offering, location: str, say: Callable[..., None]
    ) -> None:
        for restriction in sku.get("restrictions") or []:
            reason = restriction.get("reasonCode", "")
            if restriction.get("type") == "Location":
                say(
                    f"VM size {offering.server_type} is not available to this subscription at {location} "
                    f"({reason})"
                )
            else:
                zones = ",".join((restriction.get("restrictionInfo") or {}).get("zones") or [])
                say(
                    f"VM size {offering.server_type} is restricted in zones {zones} at {location} ({reason})",
                    refused=False,
                )
        arch = _capability(sku, "CpuArchitectureType")
        actual = _ARCH.get(arch.lower(), arch)
        if offering.arch and arch and actual != offering.arch:
            say(f"VM size {offering.server_type} is {actual}, not {offering.arch} as its machine type says")

    def _judge_image(
        self, offering: Offering, location: str, sku: Mapping[str, Any] | None, say: Callable[..., None]
    ) -> None:
        try:
            ref = image_reference(offering.image)
        except Permanent as err:
            say(str(err).removeprefix("azure: "))
            return
        if "publisher" not in ref:
            return  # an image resource id: not checked here
        image = self.image(location, offering.image)
        if image is None:
            say(f"no image {offering.image!r} at {location}")
            return
        arch = str((image.get("properties") or {}).get("architecture", ""))
        size_arch = _capability(sku, "CpuArchitectureType") if sku else ""
        if arch and size_arch and arch.lower() != size_arch.lower():
            say(
                f"image {offering.image!r} is {_ARCH.get(arch.lower(), arch)}: "
                f"{offering.server_type} cannot run it"
            )


def _capability(sku: Mapping[str, Any], name: str) -> str:
    return next((str(c.get("value", "")) for c in sku.get("capabilities") or [] if c.get("name") == name), "")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))
