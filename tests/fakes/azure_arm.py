"""A stateful fake of Azure Resource Manager for virtual machines, of the Microsoft Entra token
endpoint in front of it, and of the Instance Metadata Service's Scheduled Events on the machines.

Enough for the real clients: azure-identity (``ClientSecretCredential``, through MSAL) and
azure-mgmt-compute, which refuse bearer tokens over plain http, so ARM and login are served over
TLS with a throwaway CA (trustme) whose bundle is :attr:`FakeAzure.ca_bundle`::

    fake = FakeAzure().start()     # fake.url: login and ARM (https); fake.imds_url: IMDS (http)
    fake.fail_next("PUT /virtualMachines/{name}", "throttled")
    fake.fail_next("PUT /virtualMachines/{name}", "drop_after")   # act, then drop the connection
    fake.sell_out("Standard_D2as_v5", "westeurope")
    fake.evict("cc-...")           # a Preempt scheduled event, then the spot VM is deleted
    fake.stop()

What it models, each with the document it comes from:

- Entra ID's v2.0 token endpoint, client-credentials grant, and the OpenID discovery document
  MSAL reads first (https://learn.microsoft.com/entra/identity-platform/v2-oauth2-client-creds-grant-flow).
  A wrong secret is ``401 invalid_client`` with ``AADSTS7000215`` in the body's
  ``error_description`` (the body real tenants answer, e.g. OfficeDev/microsoft-365-agents-toolkit#8621).
  MSAL validates an authority other than Microsoft's own against login.microsoftonline.com
  (instance discovery): a client of this fake disables it.
- ARM's rules for every call: a bearer token (401 ``AuthenticationFailed`` without the header,
  ``InvalidAuthenticationToken`` for a token it did not issue), ``api-version`` on every request
  (400 ``MissingApiVersionParameter``), the subscription and resource group must exist (404
  ``SubscriptionNotFound`` / ``ResourceGroupNotFound``), role assignments (403
  ``AuthorizationFailed``, ``LinkedAuthorizationFailed`` for a linked resource such as the subnet),
  errors as ``{"error": {"code", "message"}}``
  (https://learn.microsoft.com/azure/azure-resource-manager/troubleshooting/common-deployment-errors).
- Virtual machines: PUT (create or update), GET (``$expand=instanceView``), ``/instanceView``,
  list by resource group (paged by ``nextLink``), DELETE, under
  ``/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines``
  (https://learn.microsoft.com/rest/api/compute/virtual-machines). Long-running operations follow
  ARM's async protocol (https://learn.microsoft.com/azure/azure-resource-manager/management/async-operations):
  a create answers 201 with ``Azure-AsyncOperation``; a delete 202 with ``Location`` and
  ``Azure-AsyncOperation``; the operation answers ``InProgress`` for ``lro_polls`` polls (or until
  ``lro_seconds`` passed: the work goes on whether anyone polls or not), then ``Succeeded`` or
  ``Failed`` with the error. The VM's ``provisioningState`` goes Creating -> Succeeded (or Failed);
  deleting a VM that does not exist answers 204.
- What a VM brings along: its NIC and public IP (created inline from
  ``networkProfile.networkInterfaceConfigurations``) and its OS disk, each deleted with the VM only
  when its ``deleteOption`` is ``Delete``; the default is ``Detach``, and a detached resource stays
  (and is billed) after the VM is gone
  (https://learn.microsoft.com/azure/virtual-machines/delete). ``leftovers()`` counts them.
- Capacity and quota: a sold-out size fails the create's operation with ``AllocationFailed``
  (``ZonalAllocationFailed`` in a zone) as the operation's error, not the PUT's answer (the
  operation status body in cloudfoundry/bosh-azure-cpi-release#443;
  https://learn.microsoft.com/troubleshoot/azure/virtual-machines/allocation-failure); Spot without
  capacity is refused at once with 409 ``SkuNotAvailable``
  (https://learn.microsoft.com/azure/virtual-machines/error-codes-spot); a regional vCPU quota is
  409 ``OperationNotAllowed`` "... exceeding approved Total Regional Cores quota ..." (the PUT's
  answer, Azure/karpenter-provider-azure#192; https://learn.microsoft.com/azure/azure-resource-manager/troubleshooting/error-resource-quota);
  throttling is 429 with code ``OperationNotAllowed`` and ``Retry-After``
  (https://learn.microsoft.com/troubleshoot/azure/virtual-machines/troubleshooting-throttling-errors).
- Resource SKUs (``GET .../providers/Microsoft.Compute/skus?$filter=location eq '...'``) with
  capabilities and ``NotAvailableForSubscription`` restrictions
  (https://learn.microsoft.com/azure/azure-resource-manager/troubleshooting/error-sku-not-available),
  marketplace image versions, and the NIC and public IP lists of Microsoft.Network.
- Scheduled Events, on a plain-http server of its own as the real IMDS is
  (https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events): each machine's
  metadata service at ``{imds_url}/{vm name}``; ``Metadata: true`` required (400 otherwise), an
  ``X-Forwarded-For`` header refused, ``api-version`` required, 5 requests a second per VM
  (429 beyond; https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service).
  Events are delivered only to a VM that asked before (the first request enables the service);
  a Spot eviction is a ``Preempt`` event at least 30 s ahead (``NotBefore``), which starts at that
  time or when approved by a ``StartRequests`` POST, then the VM is deleted.

Not modelled: availability sets, zones' own capacity, extensions, data disks, managed identity,
Azure Policy, PATCH, deallocate/start, tag-based ``$filter`` (VM lists accept none), images by
resource id (galleries, managed images: marketplace URNs only), ``Location``-header polling of a
create (creates answer ``Azure-AsyncOperation`` only), Trusted Launch, and the exact wording of
every message (codes and statuses are Azure's; messages follow the documented ones closely).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import itertools
import json
import re
import secrets
import socket
import ssl
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import trustme
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

TENANT_ID = "6d3a7c1e-2b4f-4e8a-9c0d-1f2e3a4b5c6d"
CLIENT_ID = "0f1e2d3c-4b5a-4968-8776-655443322110"
CLIENT_SECRET = "fake~Secret.Value_0123456789abcdefABCDEF"
SUBSCRIPTION_ID = "11111111-2222-4333-8444-555555555555"
RESOURCE_GROUP = "catacloud-machines"
LOCATION = "westeurope"
SUBNET_NAME = "machines"
ARM_SCOPE = "https://management.azure.com/.default"

# The catalog: resource SKUs as `az vm list-skus --all` shows them (capabilities abridged).
# B-series sizes do not run as Spot ("LowPriorityCapable": "False").
_X64, _ARM64 = {"CpuArchitectureType": "x64"}, {"CpuArchitectureType": "Arm64"}
_SIZES: dict[str, dict[str, str]] = {
    "Standard_D2as_v5": {"vCPUs": "2", "MemoryGB": "8", **_X64, "family": "standardDASv5Family"},
    "Standard_D4as_v5": {"vCPUs": "4", "MemoryGB": "16", **_X64, "family": "standardDASv5Family"},
    "Standard_D2ps_v6": {"vCPUs": "2", "MemoryGB": "8", **_ARM64, "family": "standardDPSv6Family"},
    "Standard_B2s": {"vCPUs": "2", "MemoryGB": "4", **_X64, "family": "standardBSFamily",
                     "LowPriorityCapable": "False"},
    "Standard_NC4as_T4_v3": {"vCPUs": "4", "MemoryGB": "28", "CpuArchitectureType": "x64",
                             "family": "standardNCASv3_T4Family"},
}  # fmt: skip
LOCATIONS = ("westeurope", "northeurope", "germanywestcentral", "eastus", "westus2")
# Marketplace images: publisher:offer:sku -> (architecture, versions).
IMAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "canonical:ubuntu-24_04-lts:server": ("x64", ("24.04.202410170", "24.04.202411030")),
    "canonical:ubuntu-24_04-lts:server-arm64": ("Arm64", ("24.04.202411030",)),
    "debian:debian-12:12": ("x64", ("0.20241004.1890",)),
}

# Fault kinds: HTTP status, error code, message (ARM's error body), or a transport fault.
ERRORS: dict[str, tuple[int, str, str]] = {
    "throttled": (
        429,
        "OperationNotAllowed",
        "The server rejected the request because too many requests have been received for this subscription.",
    ),
    "internal_error": (500, "InternalServerError", "Encountered internal server error."),
    "service_unavailable": (503, "ServiceUnavailable", "The service is unavailable."),
    "gateway_timeout": (
        504,
        "GatewayTimeout",
        "The gateway did not receive a response from 'Microsoft.Compute' within the specified time period.",
    ),
    "quota": (
        409,
        "OperationNotAllowed",
        "Operation could not be completed as it results in exceeding approved Total Regional Cores quota. "
        "Additional details - Deployment Model: Resource Manager, Location: westeurope, Current Limit: 10, "
        "Current Usage: 10, Additional Required: 2, (Minimum) New Limit Required: 12.",
    ),
    "sku_not_available": (
        409,
        "SkuNotAvailable",
        "The requested size for resource is currently not available in location 'westeurope' zones '' for "
        "subscription. Please try another size or deploy to a different location or zones.",
    ),
    "authorization_failed": (
        403,
        "AuthorizationFailed",
        "The client does not have authorization to perform action over scope or the scope is invalid.",
    ),
    "bad_request": (400, "InvalidParameter", "The value of parameter is invalid."),
}
# drop_before: close without acting; drop_after: act, then close without answering;
# stall: act, then answer after ``stall_seconds`` (longer than the client's read timeout).
TRANSPORT_FAULTS = ("drop_before", "drop_after", "stall")
FAULT_KINDS = (*ERRORS, *TRANSPORT_FAULTS)

_SUB = r"/subscriptions/(?P<sub>[^/]+)"
_VMS = r"/providers/Microsoft\.Compute/virtualMachines"
_LOC = r"/providers/Microsoft\.Compute/locations/(?P<loc>[^/]+)"
_RG = _SUB + r"/resourceGroups/(?P<rg>[^/]+)"
# ARM paths are case-insensitive (the SDKs and the portal differ: resourceGroups/resourcegroups).
_ROUTES: list[tuple[str, re.Pattern[str]]] = [
    (name, re.compile(pattern + "$", re.IGNORECASE))
    for name, pattern in [
        ("/virtualMachines", _RG + r"/providers/Microsoft\.Compute/virtualMachines"),
        ("/virtualMachines/{name}", _RG + r"/providers/Microsoft\.Compute/virtualMachines/(?P<name>[^/]+)"),
        ("/instanceView", _RG + _VMS + r"/(?P<name>[^/]+)/instanceView"),
        ("/operations/{id}", _SUB + _LOC + r"/operations/(?P<op>[^/]+)"),
        ("/skus", _SUB + r"/providers/Microsoft\.Compute/skus"),
        (
            "/images",
            _SUB + r"/providers/Microsoft\.Compute/locations/(?P<loc>[^/]+)/publishers/(?P<pub>[^/]+)"
            r"/artifacttypes/vmimage/offers/(?P<offer>[^/]+)/skus/(?P<sku>[^/]+)/versions(?:/(?P<version>[^/]+))?",
        ),
        ("/networkInterfaces", _RG + r"/providers/Microsoft\.Network/networkInterfaces"),
        ("/publicIPAddresses", _RG + r"/providers/Microsoft\.Network/publicIPAddresses"),
        ("/token", r"/(?P<tenant>[^/]+)/oauth2/v2\.0/token"),
        ("/openid-configuration", r"/(?P<tenant>[^/]+)/v2\.0/\.well-known/openid-configuration"),
    ]
]  # fmt: skip
# What each call needs a role to allow (https://learn.microsoft.com/azure/role-based-access-control/permissions/compute).
_ACTIONS = {
    ("GET", "/virtualMachines"): "Microsoft.Compute/virtualMachines/read",
    ("GET", "/virtualMachines/{name}"): "Microsoft.Compute/virtualMachines/read",
    ("GET", "/instanceView"): "Microsoft.Compute/virtualMachines/read",
    ("PUT", "/virtualMachines/{name}"): "Microsoft.Compute/virtualMachines/write",
    ("DELETE", "/virtualMachines/{name}"): "Microsoft.Compute/virtualMachines/delete",
    ("GET", "/operations/{id}"): "Microsoft.Compute/locations/operations/read",
    ("GET", "/skus"): "Microsoft.Compute/skus/read",
    ("GET", "/images"): "Microsoft.Compute/locations/publishers/artifacttypes/offers/skus/versions/read",
    ("GET", "/networkInterfaces"): "Microsoft.Network/networkInterfaces/read",
    ("GET", "/publicIPAddresses"): "Microsoft.Network/publicIPAddresses/read",
}
# Actions on linked resources a VM create with an inline NIC and public IP needs as well.
LINKED_ACTIONS = (
    "Microsoft.Network/virtualNetworks/subnets/join/action",
    "Microsoft.Network/networkInterfaces/write",
    "Microsoft.Network/publicIPAddresses/write",
)
_API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")
# The oldest api-version each route is served at here: deleteOption on inline NICs and public IPs
# came with Microsoft.Compute 2021-03-01 (https://learn.microsoft.com/azure/virtual-machines/delete).
_MIN_API_VERSION = {
    "/skus": "2017-09-01",
    "/networkInterfaces": "2020-11-01",
    "/publicIPAddresses": "2020-11-01",
}
_VM_API_MIN = "2021-03-01"
# VM names: 1-64 characters for Linux, letters, digits, '.', '_' and '-', no leading '_' or
# trailing '.'/'-' (https://learn.microsoft.com/azure/azure-resource-manager/management/resource-name-rules#microsoftcompute).
_VM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}[A-Za-z0-9_]$|^[A-Za-z0-9]$")
# Tag names may not contain < > % & \ ? / (https://learn.microsoft.com/azure/azure-resource-manager/management/tag-resources#limitations).
_TAG_FORBIDDEN = re.compile(r"[<>%&\\?/]")
# Linux admin user names Azure refuses (OSProfile.adminUsername, VM REST API reference; abridged).
_RESERVED_USERS = frozenset(
    [
        "administrator",
        "admin",
        "user",
        "user1",
        "test",
        "user2",
        "test1",
        "user3",
        "admin1",
        "1",
        "123",
        "a",
        "actuser",
        "adm",
        "admin2",
        "aspnet",
        "backup",
        "console",
        "david",
        "guest",
        "john",
        "owner",
        "root",
        "server",
        "sql",
        "support",
        "support_388945a0",
        "sys",
        "test2",
        "test3",
        "user4",
        "user5",
    ]
)
# Custom data: base64, at most 87380 characters (65535 bytes decoded): OSProfile.customData.
_CUSTOM_DATA_MAX = 87380


class ArmError(Exception):
    def __init__(self, status: int, code: str, message: str, *, target: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.target = status, code, message, target
        self.headers: dict[str, str] = {}


class _Drop(ConnectionResetError):
    """Raised inside the app to make werkzeug close the connection without writing a response."""


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def log_error(self, format: str, *args: Any) -> None:
        pass


@dataclasses.dataclass
class _Fault:
    kind: str
    retry_after: float | None = None


@dataclasses.dataclass
class _Operation:
    """One long-running operation: a create or a delete of one VM."""

    id: str
    kind: str  # "create" | "delete"
    vm: str
    location: str
    polls_left: int
    deadline: float
    status: str = "InProgress"
    error: dict[str, str] | None = None
    outcome: dict[str, str] | None = None  # a create's injected or capacity failure
    started: str = dataclasses.field(default_factory=lambda: _iso(datetime.now(UTC)))
    ended: str | None = None

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.id, "status": self.status, "startTime": self.started}
        if self.ended:
            body["endTime"] = self.ended
        if self.error:
            body["error"] = self.error
        return body


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _now() -> str:
    return _iso(datetime.now(UTC))


def _serve(app: Callable[..., Iterable[bytes]], ssl_context: ssl.SSLContext | None) -> BaseWSGIServer:
    return make_server(
        "127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler, ssl_context=ssl_context
    )


class FakeAzure:
    """The fake services. Thread-safe; ``requests`` records ``(method, route, status)`` of every
    ARM and login call, ``imds_requests`` ``(method, vm, path, status)`` of every IMDS call."""

    def __init__(
        self,
        *,
        lro_polls: int = 1,
        lro_seconds: float = 30.0,
        page_size: int = 50,
        stall_seconds: float = 1.0,
        notice_seconds: float = 30.0,
        evict_seconds: float = 0.2,
        first_call_delay: float = 0.0,
    ) -> None:
        self.lro_polls = lro_polls
        self.lro_seconds = lro_seconds
        self.page_size = page_size
        self.stall_seconds = stall_seconds
        self.notice_seconds = notice_seconds  # a Preempt event's notice: at least 30 s at Azure
        self.evict_seconds = evict_seconds  # from the event's start to the VM gone
        self.first_call_delay = first_call_delay  # Scheduled Events' first answer: up to 2 min at Azure
        self._lock = threading.RLock()
        self._ca = trustme.CA()
        self._cert = self._ca.issue_cert("127.0.0.1", "localhost")
        self._dir = tempfile.TemporaryDirectory(prefix="fake-azure-")
        self.ca_bundle = str(Path(self._dir.name) / "ca.pem")
        self._ca.cert_pem.write_to_path(self.ca_bundle)
        self._servers: list[BaseWSGIServer] = []
        self._threads: list[threading.Thread] = []
        # Access tokens issued -> expiry (epoch). Kept across reset(), as Entra keeps honouring a
        # token for its hour: clients (the driver's credential) hold on to theirs.
        self.tokens: dict[str, float] = {}
        self.reset()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FakeAzure:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._cert.configure_cert(context)
        self._servers = [_serve(self._arm_wsgi, context), _serve(self._imds_wsgi, None)]
        for server, name in zip(self._servers, ("fake-arm", "fake-imds"), strict=True):
            thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers, self._threads = [], []

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> FakeAzure:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        """Login (the authority) and ARM (the endpoint): https, trusted through ``ca_bundle``."""
        assert self._servers, "start() first"
        return f"https://127.0.0.1:{self._servers[0].server_port}"

    @property
    def imds_url(self) -> str:
        """The machines' metadata services: ``{imds_url}/{vm name}`` is one VM's 169.254.169.254."""
        assert self._servers, "start() first"
        return f"http://127.0.0.1:{self._servers[1].server_port}"

    @property
    def subnet_id(self) -> str:
        return (
            f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.Network"
            f"/virtualNetworks/catacloud/subnets/{SUBNET_NAME}"
        )

    def provider_config(self, **overrides: Any) -> dict[str, Any]:
        """An ``azure`` provider account's config pointing at this fake."""
        return {
            "subscription_id": SUBSCRIPTION_ID,
            "resource_group": RESOURCE_GROUP,
            "location": LOCATION,
            "subnet_id": self.subnet_id,
            "endpoint": self.url,
            "authority": self.url,
            "connection_verify": self.ca_bundle,
            **overrides,
        }

    @staticmethod
    def credentials(**overrides: str) -> dict[str, str]:
        return {"tenant_id": TENANT_ID, "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, **overrides}

    def reset(self) -> None:
        """Forget VMs, their resources, operations, faults and the logs (settings and issued
        tokens stay)."""
        with self._lock:
            self.vms: dict[str, dict[str, Any]] = {}  # by lower-cased name (ARM names are case-insensitive)
            self.custom_data: dict[str, str] = {}  # VM name -> decoded custom data
            self.nics: dict[str, dict[str, Any]] = {}
            self.public_ips: dict[str, dict[str, Any]] = {}
            self.disks: dict[str, dict[str, Any]] = {}
            self.operations: dict[str, _Operation] = {}
            self.requests: list[tuple[str, str, int]] = []
            self.imds_requests: list[tuple[str, str, str, int]] = []
            self.request_bodies: list[tuple[str, str, Any]] = []  # (method, route, JSON body) of writes
            self.denied: set[str] = set()
            self.sold_out: set[tuple[str, str]] = set()
            self.restricted: set[tuple[str, str]] = set()
            self.regional_cores: int | None = None
            self.spot_cores: int | None = None
            self.created: list[str] = []  # every VM a PUT created, in order
            self.capacity_refusals: list[tuple[str, str, float]] = []
            self._faults: dict[str, deque[_Fault]] = {}
            self._operation_faults: deque[dict[str, str]] = deque()
            self._events: dict[str, dict[str, Any]] = {}  # VM name -> its Preempt event
            self._incarnation: dict[str, int] = {}
            self._enabled: set[str] = set()  # VMs that asked for scheduled events
            self._imds_calls: dict[str, deque[float]] = {}
            self._ids = itertools.count(1)

    # ---- test controls ------------------------------------------------------------------------

    def fail_next(
        self, endpoint: str, kind: str, *, times: int = 1, retry_after: float | None = None
    ) -> None:
        """Make the next ``times`` calls to ``endpoint`` fail with ``kind`` (:data:`FAULT_KINDS`).

        ``endpoint`` is ``"METHOD route"``: ``PUT /virtualMachines/{name}``, ``GET /virtualMachines``,
        ``GET /virtualMachines/{name}``, ``DELETE /virtualMachines/{name}``, ``GET /operations/{id}``,
        ``GET /skus``, ``GET /images``, ``GET /networkInterfaces``, ``GET /publicIPAddresses``,
        ``POST /token``. ``retry_after`` sets the Retry-After header (429 carries one: 1 s unless given).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}")
        with self._lock:
            self._faults.setdefault(endpoint, deque()).extend(_Fault(kind, retry_after) for _ in range(times))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._operation_faults.clear()

    def fail_next_operation(self, code: str = "InternalExecutionError", message: str = "failed") -> None:
        """The next create's operation ends ``Failed`` with this error (the VM: provisioning Failed)."""
        with self._lock:
            self._operation_faults.append({"code": code, "message": message})

    def sell_out(self, size: str, location: str = LOCATION, *, sold_out: bool = True) -> None:
        """No capacity for ``size`` at ``location`` until restocked (``sold_out=False``): an
        on-demand create's operation fails with AllocationFailed, a Spot create is refused with
        409 SkuNotAvailable. Other sizes and locations are unaffected."""
        with self._lock:
            (self.sold_out.add if sold_out else self.sold_out.discard)((size, location))

    def restrict(self, size: str, location: str = LOCATION) -> None:
        """The subscription may not use ``size`` at ``location`` (restriction reason
        NotAvailableForSubscription); creates are refused with 409 SkuNotAvailable."""
        with self._lock:
            self.restricted.add((size, location))

    def deny(self, *actions: str) -> None:
        """Take ``actions`` (e.g. ``Microsoft.Compute/virtualMachines/read``) out of the client's role."""
        with self._lock:
            self.denied.update(actions)

    def expire_tokens(self) -> None:
        with self._lock:
            self.tokens = dict.fromkeys(self.tokens, 0.0)

    def add_vm(
        self,
        name: str,
        tags: Mapping[str, str] | None = None,
        *,
        provisioning: str = "Succeeded",
        power: str | None = "running",
        size: str = "Standard_D2as_v5",
        priority: str = "Regular",
    ) -> dict[str, Any]:
        """Put a VM straight into the resource group (no operation), e.g. to test listing."""
        with self._lock:
            vm = self._new_vm(name, LOCATION, dict(tags or {}), size, priority=priority, eviction=None)
            vm["provisioning"], vm["power"] = provisioning, power
            return vm

    def vm(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self.vms.get(name.lower())

    def leftovers(self) -> dict[str, list[str]]:
        """Disks, NICs and public IPs that exist: after every VM is deleted, what still bills."""
        with self._lock:
            return {
                "disks": sorted(self.disks),
                "networkInterfaces": sorted(self.nics),
                "publicIPAddresses": sorted(self.public_ips),
            }

    def count(self, method: str, route: str) -> int:
        with self._lock:
            return sum(1 for m, r, _ in self.requests if m == method and r == route)

    def evict(self, name: str, *, notice: float | None = None) -> dict[str, Any]:
        """Azure wants the capacity of Spot VM ``name`` back: a ``Preempt`` scheduled event with
        ``notice`` seconds (default ``notice_seconds``) before ``NotBefore``; then the event starts
        and the VM is deleted (its eviction policy is Delete). Delivered only to a VM whose
        metadata service was asked for events before (the first request enables them)."""
        with self._lock:
            vm = self.vms[name.lower()]
            if vm["priority"] != "Spot":
                raise ValueError(f"{name} is not a Spot VM: Azure evicts only those")
            at = datetime.now(UTC) + timedelta(seconds=self.notice_seconds if notice is None else notice)
            event = {
                "EventId": str(uuid.uuid4()).upper(),
                "EventStatus": "Scheduled",
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": [vm["name"]],
                "NotBefore": format_datetime(at, usegmt=True),
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
                "_at": at.timestamp(),
                "_delivered": name.lower() in self._enabled,
            }
            self._events[name.lower()] = event
            self._bump(name)
            return {k: v for k, v in event.items() if not k.startswith("_")}

    def add_event(self, name: str, event_type: str = "Freeze", *, resources: list[str] | None = None) -> None:
        """Deliver some other scheduled event to VM ``name`` (no impact modelled): e.g. a
        ``Freeze``, or a ``Preempt`` of another VM of its availability set, since "Scheduled Events
        for all virtual machines in an entire Availability Set ... are delivered to all other VMs
        in the same group": ``Resources`` says whom it is for."""
        with self._lock:
            vm = self.vms[name.lower()]
            at = datetime.now(UTC) + timedelta(minutes=15)
            self._events[name.lower()] = {
                "EventId": str(uuid.uuid4()).upper(),
                "EventStatus": "Scheduled",
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": resources if resources is not None else [vm["name"]],
                "NotBefore": format_datetime(at, usegmt=True),
                "Description": "Host server is undergoing maintenance.",
                "EventSource": "Platform",
                "DurationInSeconds": 9,
                "_at": float("inf"),  # never starts here
                "_delivered": True,
            }
            self._bump(name)

    # ---- the clock: operations and evictions progress whether anyone polls or not ------------

    def tick(self) -> None:
        with self._lock:
            now = time.time()
            for op in list(self.operations.values()):
                if op.status == "InProgress" and now >= op.deadline:
                    self._finish(op)
            for key, event in list(self._events.items()):
                if event["EventStatus"] == "Scheduled" and now >= event["_at"]:
                    self._start_eviction(key, event, at=event["_at"])
                if event["EventStatus"] == "Started" and now >= event["_at"] + self.evict_seconds:
                    self._evicted(key)

    def _start_eviction(self, key: str, event: dict[str, Any], *, at: float) -> None:
        event["EventStatus"], event["NotBefore"] = "Started", ""
        event["_at"] = at  # the VM is gone evict_seconds after the start
        vm = self.vms.get(key)
        if vm is not None:
            vm["provisioning"], vm["power"] = "Deleting", "stopping"
        self._bump(key)

    def _evicted(self, key: str) -> None:
        del self._events[key]
        vm = self.vms.get(key)
        if vm is not None:
            self._remove_vm(vm)
        self._bump(key)

    def _bump(self, name: str) -> None:
        self._incarnation[name.lower()] = self._incarnation.get(name.lower(), 1) + 1

    # ---- ARM: WSGI ------------------------------------------------------------------------------

    def _arm_wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = Request(environ)
        self.tick()
        route, match = _route(request.path)
        endpoint = f"{request.method} {route}"
        with self._lock:
            queue = self._faults.get(endpoint)
            fault = queue.popleft() if queue else None
        try:
            if fault is not None and fault.kind == "drop_before":
                self._drop(environ)
            response = self._answer(request, route, match, fault)
        except ArmError as err:
            response = _error_response(err)
            if err.status == 429:
                response.headers["Retry-After"] = str(
                    int(fault.retry_after) if fault is not None and fault.retry_after is not None else 1
                )
        with self._lock:
            self.requests.append((request.method, route, response.status_code))
        if fault is not None and fault.kind == "drop_after":
            self._drop(environ)
        if fault is not None and fault.kind == "stall":
            time.sleep(self.stall_seconds)
        return response(environ, start_response)

    def _answer(
        self, request: Request, route: str, match: re.Match[str] | None, fault: _Fault | None
    ) -> Response:
        if route in ("/token", "/openid-configuration"):
            assert match is not None
            return self._login(request, route, match["tenant"], fault)
        self._authenticate(request)
        if match is None:
            raise ArmError(404, "NotFound", f"The requested resource '{request.path}' was not found.")
        self._check_api_version(request, route)
        groups = match.groupdict()
        if groups["sub"] != SUBSCRIPTION_ID:
            raise ArmError(
                404, "SubscriptionNotFound", f"The subscription '{groups['sub']}' could not be found."
            )
        if "rg" in groups and groups["rg"].lower() != RESOURCE_GROUP.lower():
            raise ArmError(
                404, "ResourceGroupNotFound", f"Resource group '{groups['rg']}' could not be found."
            )
        self._authorize(request.method, route, request.path)
        if fault is not None and fault.kind in ERRORS:
            status, code, message = ERRORS[fault.kind]
            raise ArmError(status, code, message)
        with self._lock:
            return self._route_arm(request, route, groups)

    @staticmethod
    def _drop(environ: Mapping[str, Any]) -> None:
        sock: socket.socket = environ["werkzeug.socket"]
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        raise _Drop("connection dropped by fault injection")

    def _authenticate(self, request: Request) -> None:
        """ARM's answers to a missing, malformed, unknown or expired bearer token."""
        header = request.headers.get("Authorization")
        if header is None:
            raise _auth_error(
                "AuthenticationFailed", "Authentication failed. The 'Authorization' header is missing."
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise _auth_error(
                "AuthenticationFailedInvalidHeader",
                "Authentication failed. The 'Authorization' header is provided in an invalid format.",
            )
        with self._lock:
            expiry = self.tokens.get(token)
        if expiry is None:
            raise _auth_error("InvalidAuthenticationToken", "The access token is invalid.")
        if expiry <= time.time():
            raise _auth_error(
                "ExpiredAuthenticationToken",
                f"The access token expiry UTC time '{_iso(datetime.fromtimestamp(expiry, UTC))}' is earlier "
                f"than current UTC time '{_now()}'.",
            )

    @staticmethod
    def _check_api_version(request: Request, route: str) -> None:
        """Every ARM request names its api-version; a resource type is served from some version on."""
        versions = request.args.getlist("api-version")
        if not versions:
            raise ArmError(
                400,
                "MissingApiVersionParameter",
                "The api-version query parameter (?api-version=) is required for all requests.",
            )
        version = versions[0]
        if not _API_VERSION.match(version):
            raise ArmError(400, "InvalidApiVersionParameter", f"The api-version '{version}' is invalid.")
        if version < _MIN_API_VERSION.get(route, _VM_API_MIN):
            raise ArmError(
                400,
                "NoRegisteredProviderFound",
                f"No registered resource provider found for location '{LOCATION}' and API version "
                f"'{version}' for the requested type.",
            )

    def _authorize(self, method: str, route: str, path: str) -> None:
        action = _ACTIONS.get((method, route))
        with self._lock:
            denied = action in self.denied
        if denied:
            raise ArmError(
                403,
                "AuthorizationFailed",
                f"The client '{CLIENT_ID}' with object id '{CLIENT_ID}' does not have authorization to "
                f"perform action '{action}' over scope '{path}' or the scope is invalid. If access was "
                "recently granted, please refresh your credentials.",
            )

    # ---- login ----------------------------------------------------------------------------------

    def _login(self, request: Request, route: str, tenant: str, fault: _Fault | None) -> Response:
        if tenant != TENANT_ID:
            return _oauth_error(
                400,
                "invalid_tenant" if route == "/openid-configuration" else "invalid_request",
                90002,
                f"Tenant '{tenant}' not found. Check to make sure you have the correct tenant ID and are "
                "signing into the correct cloud.",
            )
        if route == "/openid-configuration":
            base = f"{self.url}/{tenant}"
            return _json_response(
                200,
                {
                    "token_endpoint": f"{base}/oauth2/v2.0/token",
                    "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
                    "device_authorization_endpoint": f"{base}/oauth2/v2.0/devicecode",
                    "issuer": f"{base}/v2.0",
                    "jwks_uri": f"{base}/discovery/v2.0/keys",
                    "token_endpoint_auth_methods_supported": ["client_secret_post", "private_key_jwt"],
                    "response_types_supported": ["code", "id_token", "code id_token", "id_token token"],
                },
            )
        if fault is not None and fault.kind in ERRORS:
            status = ERRORS[fault.kind][0]
            return _oauth_error(status, "temporarily_unavailable", 50196, "The server is busy; retry.")
        return self._token(request)

    def _token(self, request: Request) -> Response:
        """The client-credentials grant: which answer for which mistake, as Entra ID gives it."""
        form = request.form
        if form.get("grant_type") != "client_credentials":
            return _oauth_error(
                400, "unsupported_grant_type", 70003, "The app requested an unsupported grant type."
            )
        if form.get("client_id") != CLIENT_ID:
            return _oauth_error(
                400,
                "unauthorized_client",
                700016,
                f"Application with identifier '{form.get('client_id')}' was not found in the directory "
                f"'{TENANT_ID}'.",
            )
        if form.get("client_secret") != CLIENT_SECRET:
            return _oauth_error(
                401,
                "invalid_client",
                7000215,
                "Invalid client secret provided. Ensure the secret being sent in the request is the client "
                f"secret value, not the client secret ID, for a secret added to app '{CLIENT_ID}'.",
            )
        if form.get("scope") not in (ARM_SCOPE, f"{self.url}/.default"):
            return _oauth_error(
                400,
                "invalid_resource",
                500011,
                f"The resource principal named {form.get('scope')} was not found in the tenant named "
                f"{TENANT_ID}.",
            )
        token = "eyJ0eXAiOiJKV1QifQ." + secrets.token_urlsafe(32)
        with self._lock:
            self.tokens[token] = time.time() + 3599
        return _json_response(
            200, {"token_type": "Bearer", "expires_in": 3599, "ext_expires_in": 3599, "access_token": token}
        )

    # ---- ARM routes (called with the lock held) ---------------------------------------------

    def _route_arm(self, request: Request, route: str, groups: dict[str, str]) -> Response:
        method = request.method
        if route == "/virtualMachines" and method == "GET":
            return self._list(request, [self._vm_json(vm, request) for vm in self._sorted_vms()])
        if route == "/virtualMachines/{name}" and method == "GET":
            return _json_response(200, self._vm_json(self._get_vm(groups["name"]), request))
        if route == "/instanceView" and method == "GET":
            return _json_response(200, self._instance_view(self._get_vm(groups["name"])))
        if route == "/virtualMachines/{name}" and method == "PUT":
            return self._put_vm(request, groups["name"])
        if route == "/virtualMachines/{name}" and method == "DELETE":
            return self._delete_vm(request, groups["name"])
        if route == "/operations/{id}" and method == "GET":
            return self._poll(groups["op"])
        if route == "/skus" and method == "GET":
            return self._skus(request)
        if route == "/images" and method == "GET":
            return self._images(groups)
        if route == "/networkInterfaces" and method == "GET":
            return self._list(request, [self._nic_json(n) for _, n in sorted(self.nics.items())])
        if route == "/publicIPAddresses" and method == "GET":
            return self._list(request, [self._ip_json(p) for _, p in sorted(self.public_ips.items())])
        raise ArmError(405, "MethodNotAllowed", f"The method '{method}' is not allowed for '{request.path}'.")

    def _sorted_vms(self) -> list[dict[str, Any]]:
        return sorted(self.vms.values(), key=lambda vm: vm["seq"])

    def _list(self, request: Request, items: list[dict[str, Any]]) -> Response:
        """One page of ``value`` and, while more follow, a ``nextLink`` carrying the api-version
        and a ``$skiptoken`` (ARM's paging: the client follows nextLink as given)."""
        try:
            start = int(request.args.get("$skiptoken", "0"))
        except ValueError:
            raise ArmError(400, "InvalidSkipToken", "The provided skip token is invalid.") from None
        page: dict[str, Any] = {"value": items[start : start + self.page_size]}
        if start + self.page_size < len(items):
            args = request.args.to_dict()
            args["$skiptoken"] = str(start + self.page_size)
            query = "&".join(f"{k}={v}" for k, v in args.items())
            page["nextLink"] = f"{self.url}{request.path}?{query}"
        return _json_response(200, page)

    def _get_vm(self, name: str) -> dict[str, Any]:
        vm = self.vms.get(name.lower())
        if vm is None:
            raise ArmError(
                404,
                "ResourceNotFound",
                f"The Resource 'Microsoft.Compute/virtualMachines/{name}' under resource group "
                f"'{RESOURCE_GROUP}' was not found. For more details please go to https://aka.ms/ARMResourceNotFoundFix",
            )
        return vm

    # ---- create -------------------------------------------------------------------------------

    def _put_vm(self, request: Request, name: str) -> Response:
        body = _json_body(request)
        self.request_bodies.append(("PUT", name, body))
        existing = self.vms.get(name.lower())
        if existing is not None:
            return self._update_vm(request, existing, body)
        if not _VM_NAME.match(name):
            raise ArmError(400, "InvalidResourceName", f"Resource name {name} is invalid.")
        checked = _check_vm_body(body, request.path)
        self._check_linked(request.path)
        size, location, spot = checked["size"], checked["location"], checked["spot"]
        self._check_capacity_and_quota(request.path, size, location, spot)
        vm = self._new_vm(
            name, location, checked["tags"], size, priority=checked["priority"], eviction=checked["eviction"]
        )
        vm.update(image=checked["image"], zones=body.get("zones") or [], admin=checked["admin"])
        self.custom_data[vm["name"]] = checked["custom_data"]
        self._attach(vm, body["properties"])
        self.created.append(vm["name"])
        op = self._operation("create", vm)
        if self._operation_faults:
            op.outcome = self._operation_faults.popleft()
        elif (size, location) in self.sold_out:
            self.capacity_refusals.append((size, location, time.time()))
            op.outcome = {
                "code": "ZonalAllocationFailed" if vm["zones"] else "AllocationFailed",
                "message": "Allocation failed. We do not have sufficient capacity for the requested VM size "
                "in this region. Read more about improving likelihood of allocation success at "
                "http://aka.ms/allocation-guidance",
            }
        response = _json_response(201, self._vm_json(vm, request))
        response.headers["Azure-AsyncOperation"] = self._op_url(op, request)
        response.headers["Azure-AsyncNotification"] = "Enabled"
        return response

    def _check_linked(self, path: str) -> None:
        """Creating a VM with an inline NIC and public IP in a subnet also needs rights on those
        (LinkedAuthorizationFailed names the first one missing)."""
        for action in LINKED_ACTIONS:
            if action in self.denied:
                raise ArmError(
                    403,
                    "LinkedAuthorizationFailed",
                    f"The client '{CLIENT_ID}' has permission to perform action "
                    f"'Microsoft.Compute/virtualMachines/write' on scope '{path}'; however, it does not have "
                    f"permission to perform action(s) '{action}' on the linked scope(s) '{self.subnet_id}' "
                    "(respectively) or the linked scope(s) are invalid.",
                )

    def _check_capacity_and_quota(self, path: str, size: str, location: str, spot: bool) -> None:
        caps = _SIZES[size]
        if (size, location) in self.restricted or (spot and (size, location) in self.sold_out):
            if spot and (size, location) in self.sold_out:
                self.capacity_refusals.append((size, location, time.time()))
            raise ArmError(
                409,
                "SkuNotAvailable",
                f"The requested size for resource '{path}' is currently not available in location "
                f"'{location}' zones '' for subscription '{SUBSCRIPTION_ID}'. Please try another size or "
                "deploy to a different location or zones. See https://aka.ms/azureskunotavailable for "
                "details.",
            )
        if spot and caps.get("LowPriorityCapable") == "False":
            raise ArmError(
                400,
                "AzureSpotIsNotSupportedForThisVMSize",
                f"Azure Spot Virtual Machine is not supported for this VM size {size}.",
            )
        limit, usage_name = (
            (self.spot_cores, "Low-priority vCPUs") if spot else (self.regional_cores, "Cores")
        )
        if limit is None:
            return
        used = sum(
            int(_SIZES[vm["size"]]["vCPUs"])
            for vm in self.vms.values()
            if (vm["priority"] == "Spot") == spot and vm["location"] == location
        )
        need = int(caps["vCPUs"])
        if used + need > limit:
            raise ArmError(
                409,
                "OperationNotAllowed",
                f"Operation could not be completed as it results in exceeding approved Total Regional "
                f"{usage_name} quota. Additional details - Deployment Model: Resource Manager, Location: "
                f"{location}, Current Limit: {limit}, Current Usage: {used}, Additional Required: {need}, "
                f"(Minimum) New Limit Required: {used + need}.",
            )

    def _update_vm(self, request: Request, vm: dict[str, Any], body: dict[str, Any]) -> Response:
        """A PUT to an existing VM: refused while another operation runs on it (409
        AnotherOperationInProgress, "wait for concurrent operation to complete", common deployment
        errors; OperationNotAllowed while it is being deleted), and for properties that cannot
        change after creation (PropertyChangeNotAllowed); otherwise an update of its tags."""
        if vm["provisioning"] == "Deleting":
            raise ArmError(
                409,
                "OperationNotAllowed",
                f"Operation 'PUT' is not allowed on VM '{vm['name']}' since the VM is marked for deletion. "
                "You can only retry the Delete operation (or wait for an ongoing one to complete).",
            )
        if any(op.vm == vm["name"] and op.status == "InProgress" for op in self.operations.values()):
            raise ArmError(
                409,
                "AnotherOperationInProgress",
                f"Operation 'Create or Update Virtual Machine' is not allowed on VM '{vm['name']}' since "
                "another operation is in progress.",
            )
        properties = body.get("properties") or {}
        size = (properties.get("hardwareProfile") or {}).get("vmSize")
        if size is not None and size != vm["size"]:
            raise ArmError(409, "PropertyChangeNotAllowed", "Changing property 'vmSize' is not allowed.")
        vm["tags"] = dict(body.get("tags") or {})
        op = self._operation("update", vm)
        self._finish(op)
        response = _json_response(200, self._vm_json(vm, request))
        response.headers["Azure-AsyncOperation"] = self._op_url(op, request)
        return response

    def _new_vm(
        self,
        name: str,
        location: str,
        tags: dict[str, str],
        size: str,
        *,
        priority: str,
        eviction: str | None,
    ) -> dict[str, Any]:
        vm = {
            "name": name,
            "seq": next(self._ids),
            "location": location,
            "tags": tags,
            "size": size,
            "priority": priority,
            "eviction": eviction,
            "provisioning": "Creating",
            "power": None,
            "failure": None,
            "vmId": str(uuid.uuid4()),
            "created": _now(),
            "image": {},
            "zones": [],
            "admin": "",
            "nic": None,
            "disk": None,
        }
        self.vms[name.lower()] = vm
        return vm

    def _attach(self, vm: dict[str, Any], properties: dict[str, Any]) -> None:
        """Create the OS disk, and each NIC (and its public IP) the body asks for inline."""
        os_disk = properties["storageProfile"].get("osDisk") or {}
        disk_name = os_disk.get("name") or f"{vm['name']}_OsDisk_1_{uuid.uuid4().hex}"
        self.disks[disk_name] = {
            "name": disk_name,
            "vm": vm["name"],
            "deleteOption": os_disk.get("deleteOption", "Detach"),
            "sizeGB": os_disk.get("diskSizeGB", 30),
        }
        vm["disk"] = disk_name
        for config in properties["networkProfile"].get("networkInterfaceConfigurations") or []:
            nic = {
                "name": config["name"],
                "vm": vm["name"],
                "deleteOption": config["properties"].get("deleteOption", "Detach"),
                "privateIp": f"10.0.{vm['seq'] // 250}.{vm['seq'] % 250 + 4}",
                "publicIp": None,
            }
            ip_config = config["properties"]["ipConfigurations"][0]["properties"]
            public = ip_config.get("publicIPAddressConfiguration")
            if public is not None:
                self.public_ips[public["name"]] = {
                    "name": public["name"],
                    "address": f"20.{vm['seq'] // 65536 % 256}.{vm['seq'] // 256 % 256}.{vm['seq'] % 256}",
                    "deleteOption": (public.get("properties") or {}).get("deleteOption", "Detach"),
                    "sku": (public.get("sku") or {}).get("name", "Standard"),
                }
                nic["publicIp"] = public["name"]
            self.nics[nic["name"]] = nic
            vm["nic"] = nic["name"]

    def _operation(self, kind: str, vm: dict[str, Any]) -> _Operation:
        op = _Operation(
            id=str(uuid.uuid4()),
            kind=kind,
            vm=vm["name"],
            location=vm["location"],
            polls_left=self.lro_polls,
            deadline=time.time() + self.lro_seconds,
        )
        self.operations[op.id] = op
        return op

    def _op_url(self, op: _Operation, request: Request) -> str:
        version = request.args.get("api-version")
        return (
            f"{self.url}/subscriptions/{SUBSCRIPTION_ID}/providers/Microsoft.Compute/locations/{op.location}"
            f"/operations/{op.id}?p={uuid.uuid4()}&api-version={version}"
        )

    def _poll(self, op_id: str) -> Response:
        op = self.operations.get(op_id)
        if op is None:
            raise ArmError(404, "NotFound", f"The operation '{op_id}' was not found.")
        if op.status == "InProgress":
            op.polls_left -= 1
            if op.polls_left <= 0:
                self._finish(op)
        return _json_response(200, op.as_json())

    def _finish(self, op: _Operation) -> None:
        """The operation's work is done: a create's VM runs (or failed), a delete's VM is gone."""
        op.ended = _now()
        vm = self.vms.get(op.vm.lower())
        if op.kind == "delete":
            op.status = "Succeeded"
            if vm is not None:
                self._remove_vm(vm)
            return
        if op.outcome is not None:
            op.status, op.error = "Failed", dict(op.outcome)
            if vm is not None:
                vm["provisioning"], vm["power"], vm["failure"] = "Failed", None, dict(op.outcome)
            return
        op.status = "Succeeded"
        if vm is not None and vm["provisioning"] == "Creating":
            vm["provisioning"], vm["power"] = "Succeeded", "running"

    # ---- delete -------------------------------------------------------------------------------

    def _delete_vm(self, request: Request, name: str) -> Response:
        vm = self.vms.get(name.lower())
        if vm is None:
            return Response(status=204)  # Virtual Machines - Delete: 204 when there is nothing to delete
        for op in self.operations.values():
            if op.vm == vm["name"] and op.status == "InProgress" and op.kind == "create":
                op.status, op.ended = "Canceled", _now()
                op.error = {
                    "code": "OperationPreempted",
                    "message": "Operation execution has been preempted.",
                }
        running = [o for o in self.operations.values() if o.vm == vm["name"] and o.kind == "delete"]
        op = next((o for o in running if o.status == "InProgress"), None) or self._operation("delete", vm)
        vm["provisioning"], vm["power"] = "Deleting", "stopping"
        response = Response(status=202)
        url = self._op_url(op, request)
        response.headers["Azure-AsyncOperation"] = url
        response.headers["Location"] = url + "&monitor=true"
        return response

    def _remove_vm(self, vm: dict[str, Any]) -> None:
        """The VM goes; its disk, NIC and public IP go with it only when their deleteOption says so."""
        self.vms.pop(vm["name"].lower(), None)
        self._events.pop(vm["name"].lower(), None)
        disk = self.disks.get(vm["disk"] or "")
        if disk is not None:
            disk["vm"] = None
            if disk["deleteOption"] == "Delete":
                del self.disks[disk["name"]]
        nic = self.nics.get(vm["nic"] or "")
        if nic is not None:
            nic["vm"] = None
            public = self.public_ips.get(nic["publicIp"] or "")
            if nic["deleteOption"] == "Delete":
                del self.nics[nic["name"]]
                if public is not None and public["deleteOption"] == "Delete":
                    del self.public_ips[public["name"]]

    # ---- answers --------------------------------------------------------------------------------

    def _vm_json(self, vm: dict[str, Any], request: Request) -> dict[str, Any]:
        name = vm["name"]
        group = f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}"
        vm_id = f"{group}/providers/Microsoft.Compute/virtualMachines/{name}"
        nic = self.nics.get(vm["nic"] or "")
        properties: dict[str, Any] = {
            "vmId": vm["vmId"],
            "hardwareProfile": {"vmSize": vm["size"]},
            "storageProfile": {
                "imageReference": vm["image"],
                "osDisk": {"osType": "Linux", "name": vm["disk"], "createOption": "FromImage"},
            },
            # customData is write-only: never in an answer (OSProfile.customData).
            "osProfile": {"computerName": name, "adminUsername": vm["admin"]},
            "networkProfile": {
                "networkInterfaces": [
                    {
                        "id": self._nic_json(nic)["id"],
                        "properties": {"primary": True, "deleteOption": nic["deleteOption"]},
                    }
                ]
                if nic
                else []
            },
            "priority": vm["priority"],
            "provisioningState": vm["provisioning"],
            "timeCreated": vm["created"],
        }
        if vm["eviction"]:
            properties["evictionPolicy"] = vm["eviction"]
        expand = request.args.get("$expand", "")
        if expand.lower() == "instanceview":
            properties["instanceView"] = self._instance_view(vm)
        body = {
            "name": name,
            "id": vm_id,
            "type": "Microsoft.Compute/virtualMachines",
            "location": vm["location"],
            "properties": properties,
        }
        if vm["tags"]:
            body["tags"] = dict(vm["tags"])
        if vm["zones"]:
            body["zones"] = list(vm["zones"])
        return body

    @staticmethod
    def _instance_view(vm: dict[str, Any]) -> dict[str, Any]:
        """Statuses as the instance view lists them: ``ProvisioningState/<state>[/<error code>]``
        and, once the VM has one, ``PowerState/<state>``."""
        state = vm["provisioning"].lower()
        failure = vm["failure"]
        statuses: list[dict[str, Any]] = [
            {
                "code": f"ProvisioningState/{state}" + (f"/{failure['code']}" if failure else ""),
                "level": "Error" if failure else "Info",
                "displayStatus": "Provisioning failed" if failure else f"Provisioning {state}",
                **({"message": failure["message"]} if failure else {}),
            }
        ]
        if vm["power"]:
            statuses.append(
                {"code": f"PowerState/{vm['power']}", "level": "Info", "displayStatus": f"VM {vm['power']}"}
            )
        return {"computerName": vm["name"], "osName": "ubuntu", "statuses": statuses}

    def _nic_json(self, nic: dict[str, Any]) -> dict[str, Any]:
        base = f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.Network"
        ip_config: dict[str, Any] = {
            "privateIPAddress": nic["privateIp"],
            "privateIPAllocationMethod": "Dynamic",
            "subnet": {"id": self.subnet_id},
            "primary": True,
        }
        if nic["publicIp"]:
            ip_config["publicIPAddress"] = {"id": f"{base}/publicIPAddresses/{nic['publicIp']}"}
        properties: dict[str, Any] = {
            "ipConfigurations": [{"name": "ipconfig1", "properties": ip_config}],
            "primary": True,
        }
        if nic["vm"]:
            properties["virtualMachine"] = {
                "id": f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}/providers"
                f"/Microsoft.Compute/virtualMachines/{nic['vm']}"
            }
        return {
            "name": nic["name"],
            "id": f"{base}/networkInterfaces/{nic['name']}",
            "properties": properties,
        }

    @staticmethod
    def _ip_json(ip: dict[str, Any]) -> dict[str, Any]:
        base = f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.Network"
        return {
            "name": ip["name"],
            "id": f"{base}/publicIPAddresses/{ip['name']}",
            "sku": {"name": ip["sku"], "tier": "Regional"},
            "properties": {"ipAddress": ip["address"], "publicIPAllocationMethod": "Static"},
        }

    def _skus(self, request: Request) -> Response:
        """Resource SKUs: ``$filter`` takes only ``location eq '<location>'`` (Resource Skus - List)."""
        wanted = None
        if flt := request.args.get("$filter"):
            m = re.fullmatch(r"location eq '([a-z0-9]+)'", flt.strip())
            if m is None:
                raise ArmError(
                    400,
                    "InvalidFilter",
                    f"The filter '{flt}' is not supported; use location eq '<location>'.",
                )
            wanted = m.group(1)
        items = [
            _sku_json(size, location, (size, location) in self.restricted)
            for location in LOCATIONS
            if wanted in (None, location)
            for size in _SIZES
        ]
        return _json_response(200, {"value": items})

    @staticmethod
    def _images(groups: dict[str, str]) -> Response:
        key = f"{groups['pub']}:{groups['offer']}:{groups['sku']}".lower()
        image = IMAGES.get(key)
        if image is None or groups["loc"] not in LOCATIONS:
            raise ArmError(404, "NotFound", "Artifact: VMImage was not found.")
        arch, versions = image
        base = (
            f"/Subscriptions/{SUBSCRIPTION_ID}/Providers/Microsoft.Compute/Locations/{groups['loc']}"
            f"/Publishers/{groups['pub']}/ArtifactTypes/VMImage/Offers/{groups['offer']}/Skus/{groups['sku']}/Versions"
        )
        version = groups.get("version")
        if version is None:
            return _json_response(
                200, [{"location": groups["loc"], "name": v, "id": f"{base}/{v}"} for v in versions]
            )
        if version not in versions:
            raise ArmError(404, "NotFound", "Artifact: VMImage was not found.")
        return _json_response(
            200,
            {
                "location": groups["loc"],
                "name": version,
                "id": f"{base}/{version}",
                "properties": {
                    "architecture": arch,
                    "hyperVGeneration": "V2",
                    "osDiskImage": {"operatingSystem": "Linux"},
                },
            },
        )

    # ---- IMDS: Scheduled Events ------------------------------------------------------------------

    def _imds_wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = Request(environ)
        self.tick()
        vm_name, _, path = request.path.lstrip("/").partition("/")
        path = "/" + path
        try:
            response = self._imds(request, vm_name, path)
        except ArmError as err:
            response = _json_response(err.status, {"error": err.message})
        with self._lock:
            self.imds_requests.append((request.method, vm_name, path, response.status_code))
        return response(environ, start_response)

    def _imds(self, request: Request, vm_name: str, path: str) -> Response:
        """The metadata service's rules, then its two answers we use: the VM's name and its events."""
        if request.headers.get("Metadata", "").lower() != "true" or "X-Forwarded-For" in request.headers:
            raise ArmError(400, "", "Bad request. Required metadata header not specified")
        if not request.args.get("api-version"):
            raise ArmError(
                400,
                "",
                "Bad request. api-version is invalid or was not specified in the request. For more "
                "information refer to aka.ms/azureimds",
            )
        with self._lock:
            vm = self.vms.get(vm_name.lower())
            if vm is None:
                raise ArmError(404, "", "Not found")
            calls = self._imds_calls.setdefault(vm_name.lower(), deque())
            now = time.monotonic()
            while calls and now - calls[0] > 1.0:
                calls.popleft()
            if len(calls) >= 5:
                raise ArmError(429, "", "Too many requests")
            calls.append(now)
        if path == "/metadata/instance/compute/name" and request.method == "GET":
            if request.args.get("format") != "text":  # a leaf needs format=text (IMDS: route parameters)
                raise ArmError(400, "", "Bad request. Query parameter format=text is required for leaf nodes")
            return Response(vm["name"], 200, mimetype="text/plain")
        if path == "/metadata/scheduledevents":
            return self._scheduled_events(request, vm)
        raise ArmError(404, "", "Not found")

    def _scheduled_events(self, request: Request, vm: dict[str, Any]) -> Response:
        key = vm["name"].lower()
        if request.method == "POST":
            return self._approve(request, key)
        with self._lock:
            first = key not in self._enabled
            self._enabled.add(key)
        if first and self.first_call_delay:
            time.sleep(self.first_call_delay)  # "a delayed response in your first call of up to two minutes"
        with self._lock:
            event = self._events.get(key)
            events = (
                []
                if event is None or not event["_delivered"]
                else [{k: v for k, v in event.items() if not k.startswith("_")}]
            )
            return _json_response(
                200, {"DocumentIncarnation": self._incarnation.get(key, 1), "Events": events}
            )

    def _approve(self, request: Request, key: str) -> Response:
        """``StartRequests``: the event may start now instead of at its NotBefore."""
        try:
            ids = [r["EventId"] for r in (json.loads(request.get_data() or b"null") or {})["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            raise ArmError(400, "", "Bad request. The request body is malformed.") from None
        with self._lock:
            event = self._events.get(key)
            if event is None or event["EventId"] not in ids:
                raise ArmError(400, "", "Bad request. The event id is not valid.")
            if event["EventStatus"] == "Scheduled":
                self._start_eviction(key, event, at=time.time())
        return Response(status=200)


# ---- request checks -----------------------------------------------------------------------------


def _route(path: str) -> tuple[str, re.Match[str] | None]:
    for name, pattern in _ROUTES:
        if m := pattern.match(path):
            return name, m
    return path, None


def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(request.get_data() or b"null")
    except ValueError:
        raise ArmError(
            400, "InvalidRequestContent", "The request content was invalid and could not be deserialized."
        ) from None
    if not isinstance(body, dict):
        raise ArmError(
            400, "InvalidRequestContent", "The request content was invalid and could not be deserialized."
        )
    return body


def _invalid(message: str, target: str) -> ArmError:
    return ArmError(400, "InvalidParameter", message, target=target)


def _check_vm_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """What the Virtual Machines - Create Or Update reference requires of a Linux VM from a
    marketplace image, with the errors Azure answers (abridged to what a driver can get wrong)."""
    location = body.get("location")
    if not location:
        raise ArmError(400, "LocationRequired", "The location property is required for this definition.")
    if location not in LOCATIONS:
        raise ArmError(
            400,
            "LocationNotAvailableForResourceType",
            f"The provided location '{location}' is not available for resource type "
            f"'Microsoft.Compute/virtualMachines'. List of available regions for the resource type is "
            f"'{','.join(LOCATIONS)}'.",
        )
    tags = _check_tags(body.get("tags") or {})
    properties = body.get("properties") or {}
    size = (properties.get("hardwareProfile") or {}).get("vmSize")
    if size not in _SIZES:
        raise _invalid(f"The value {size} provided for the VM size is not valid.", "hardwareProfile.vmSize")
    image = _check_image(properties.get("storageProfile") or {})
    os_profile = _check_os_profile(properties.get("osProfile") or {})
    _check_network(properties.get("networkProfile") or {})
    spot = _check_spot(properties)
    return {
        "location": location,
        "tags": tags,
        "size": size,
        "image": image,
        "spot": spot,
        "priority": "Spot" if spot else "Regular",
        "eviction": properties.get("evictionPolicy"),
        **os_profile,
    }


def _check_tags(tags: Mapping[str, Any]) -> dict[str, str]:
    if len(tags) > 50:
        raise ArmError(400, "InvalidTagsCount", "A resource can have at most 50 tags.")
    for name, value in tags.items():
        if _TAG_FORBIDDEN.search(name):
            raise ArmError(
                400,
                "InvalidTagNameCharacters",
                f"The tag names '{name}' have reserved characters '<,>,%,&,\\,?,/' or control characters.",
            )
        if len(name) > 512 or not isinstance(value, str) or len(value) > 256:
            raise ArmError(400, "InvalidTag", f"The tag '{name}' is too long or its value is not a string.")
    return dict(tags)


def _check_image(storage: Mapping[str, Any]) -> dict[str, str]:
    ref = storage.get("imageReference") or {}
    key = f"{ref.get('publisher')}:{ref.get('offer')}:{ref.get('sku')}".lower()
    image = IMAGES.get(key)
    version = ref.get("version", "")
    if image is None or (version != "latest" and version not in image[1]):
        urn = f"{ref.get('publisher')}:{ref.get('offer')}:{ref.get('sku')}:{version}"
        err = ArmError(
            404,
            "PlatformImageNotFound",
            f"The platform image '{urn}' is not available. Verify that all fields in the storage profile are "
            "correct. For more details about storage profile information, please refer to https://aka.ms/storageprofile",
            target="imageReference",
        )
        raise err
    os_disk = storage.get("osDisk") or {}
    if os_disk.get("deleteOption", "Detach") not in ("Delete", "Detach"):
        raise _invalid("The value of parameter osDisk.deleteOption is invalid.", "osDisk.deleteOption")
    return {k: str(v) for k, v in ref.items()}


def _check_os_profile(profile: Mapping[str, Any]) -> dict[str, str]:
    admin = profile.get("adminUsername") or ""
    if not admin:
        raise _invalid("Required parameter 'adminUsername' is missing (null).", "adminUsername")
    if admin.lower() in _RESERVED_USERS or len(admin) > 64:
        raise _invalid("The Admin Username specified is not allowed.", "adminUsername")
    computer = profile.get("computerName") or ""
    if not computer or len(computer) > 64:
        raise _invalid(
            "Linux host name cannot exceed 64 characters in length or contain the following characters.",
            "computerName",
        )
    linux = profile.get("linuxConfiguration") or {}
    keys = (linux.get("ssh") or {}).get("publicKeys") or []
    if linux.get("disablePasswordAuthentication") and not keys:
        raise _invalid(
            "Authentication using either SSH or by user name and password must be enabled in Linux profile.",
            "linuxConfiguration",
        )
    if not linux.get("disablePasswordAuthentication") and not profile.get("adminPassword"):
        raise _invalid("Required parameter 'adminPassword' is missing (null).", "adminPassword")
    for key in keys:
        if key.get("path") != f"/home/{admin}/.ssh/authorized_keys":
            raise _invalid(
                "The value of parameter linuxConfiguration.ssh.publicKeys.path is invalid.",
                "linuxConfiguration.ssh.publicKeys.path",
            )
        if not str(key.get("keyData", "")).startswith("ssh-rsa "):
            raise _invalid(
                "The value of parameter linuxConfiguration.ssh.publicKeys.keyData is invalid.",
                "linuxConfiguration.ssh.publicKeys.keyData",
            )
    return {"admin": admin, "custom_data": _custom_data(profile.get("customData"))}


def _custom_data(encoded: Any) -> str:
    if encoded is None:
        return ""
    message = (
        "Custom data in OSProfile must be in Base64 encoding and with a maximum length of 87380 characters."
    )
    if not isinstance(encoded, str) or len(encoded) > _CUSTOM_DATA_MAX:
        raise _invalid(message, "customData")
    try:
        return base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise _invalid(message, "customData") from None


def _check_network(network: Mapping[str, Any]) -> None:
    configs = network.get("networkInterfaceConfigurations") or []
    if not configs and not network.get("networkInterfaces"):
        raise _invalid("At least one network interface must be specified.", "networkProfile")
    if configs and not network.get("networkApiVersion"):
        raise _invalid(
            "Required parameter 'networkProfile.networkApiVersion' is missing (null).",
            "networkProfile.networkApiVersion",
        )
    for config in configs:
        for ip_config in (config.get("properties") or {}).get("ipConfigurations") or [{}]:
            props = ip_config.get("properties") or {}
            subnet = (props.get("subnet") or {}).get("id", "")
            if not subnet.lower().endswith(f"/subnets/{SUBNET_NAME}"):
                raise ArmError(
                    400,
                    "InvalidResourceReference",
                    f"Resource {subnet} referenced by resource {config.get('name')} was not found. Please "
                    "make sure that the referenced resource exists, and that both resources are in the same "
                    "region.",
                )
            public = props.get("publicIPAddressConfiguration")
            if public is not None and (public.get("sku") or {}).get("name", "Basic") != "Standard":
                # Basic public IPs were retired on 2025-09-30
                # (learn.microsoft.com/azure/virtual-network/ip-services/public-ip-basic-upgrade-guidance)
                raise _invalid(
                    "Basic SKU public IP addresses can no longer be created.",
                    "publicIPAddressConfiguration.sku",
                )


def _check_spot(properties: Mapping[str, Any]) -> bool:
    """Priority, eviction policy and max price: the rules of Spot error codes
    (https://learn.microsoft.com/azure/virtual-machines/error-codes-spot)."""
    spot = properties.get("priority") in ("Spot", "Low")
    if properties.get("evictionPolicy") and not spot:
        raise ArmError(
            400,
            "EvictionPolicyCanBeSetOnlyOnAzureSpotVirtualMachines",
            "Eviction policy can be set only on Azure Spot Virtual Machines.",
        )
    max_price = (properties.get("billingProfile") or {}).get("maxPrice")
    if max_price is not None and not spot:
        raise ArmError(
            400,
            "MaxPriceIsSupportedOnlyForAzureSpotVirtualMachines",
            "Max price is supported only for Azure Spot Virtual Machines.",
        )
    if (
        max_price is not None
        and max_price != -1
        and not (isinstance(max_price, int | float) and max_price > 0)
    ):
        raise ArmError(
            400,
            "MaxPriceValueInvalid",
            "Invalid max price value. The only supported values for max price are -1 or a decimal greater "
            "than zero.",
        )
    return spot


def _sku_json(size: str, location: str, restricted: bool) -> dict[str, Any]:
    caps = _SIZES[size]
    capabilities = [{"name": k, "value": v} for k, v in caps.items() if k != "family"]
    if "LowPriorityCapable" not in caps:
        capabilities.append({"name": "LowPriorityCapable", "value": "True"})
    restrictions = []
    if restricted:
        restrictions.append(
            {
                "type": "Location",
                "values": [location],
                "restrictionInfo": {"locations": [location]},
                "reasonCode": "NotAvailableForSubscription",
            }
        )
    return {
        "resourceType": "virtualMachines",
        "name": size,
        "tier": "Standard",
        "size": size.removeprefix("Standard_"),
        "family": caps["family"],
        "locations": [location],
        "locationInfo": [{"location": location, "zones": ["1", "2", "3"], "zoneDetails": []}],
        "capabilities": capabilities,
        "restrictions": restrictions,
    }


# ---- responses ----------------------------------------------------------------------------------


def _json_response(status: int, body: Any) -> Response:
    return Response(json.dumps(body), status, mimetype="application/json")


def _error_response(err: ArmError) -> Response:
    error: dict[str, Any] = {"code": err.code, "message": err.message}
    if err.target:
        error["target"] = err.target
    if err.status == 429:
        error["details"] = [
            {"code": "TooManyRequests", "target": "PutVMSubscriptionMaximum", "message": "{}"}
        ]
    response = _json_response(err.status, {"error": error})
    response.headers.update(err.headers)
    return response


def _auth_error(code: str, message: str) -> ArmError:
    err = ArmError(401, code, message)
    err.headers["WWW-Authenticate"] = (
        'Bearer authorization_uri="https://login.microsoftonline.com/", error="invalid_token", '
        f'error_description="{message}"'
    )
    return err


def _oauth_error(status: int, error: str, aadsts: int, description: str) -> Response:
    """Entra ID's OAuth error body: the AADSTS code leads the description."""
    trace = str(uuid.uuid4())
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return _json_response(
        status,
        {
            "error": error,
            "error_description": f"AADSTS{aadsts}: {description} Trace ID: {trace} Correlation ID: "
            f"{uuid.uuid4()} Timestamp: {stamp}",
            "error_codes": [aadsts],
            "timestamp": stamp,
            "trace_id": trace,
            "correlation_id": str(uuid.uuid4()),
            "error_uri": f"https://login.microsoftonline.com/error?code={aadsts}",
        },
    )


__all__ = [
    "CLIENT_ID",
    "CLIENT_SECRET",
    "FAULT_KINDS",
    "IMAGES",
    "LOCATION",
    "RESOURCE_GROUP",
    "SUBSCRIPTION_ID",
    "TENANT_ID",
    "FakeAzure",
]
