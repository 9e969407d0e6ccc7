"""Hetzner Cloud driver on the official ``hcloud`` client.

Config: ``location`` (default for specs without one), optional ``api_endpoint``, ``ssh_keys``
(names or ids), ``network`` (id), ``poll_interval`` (s, default 1), ``poll_max_retries``
(default 120), ``timeout`` (request timeout s, default 30), ``retry_attempts`` (default 4),
``retry_backoff`` (first delay s, doubles, default 1), ``retry_max_delay`` (s, default 30).
Credentials: ``token``.

Hetzner has no idempotency key. The server name ``cc-<instance uuid>`` is unique per project,
so a 409 ``uniqueness_error`` on create means "already created": the driver adopts that server
after checking its ``catacloud/instance`` label. That also makes a create whose response was
lost safe to retry.

Retries live here, in one place: hcloud's built-in retry is switched off because its backoff
(up to 60 s) is not configurable, it ignores ``Retry-After`` and it does not retry dropped
connections. The driver retries 429, 5xx, timeouts and connection errors ``retry_attempts``
times with exponential backoff, then raises the typed error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

import requests
from hcloud import APIException, Client, HCloudException
from hcloud.actions import ActionFailedException, ActionTimeoutException, BoundAction
from hcloud.deprecation import DeprecationInfo
from hcloud.images import BoundImage, Image
from hcloud.locations import Location
from hcloud.networks import Network
from hcloud.server_types import BoundServerType, ServerType
from hcloud.servers import BoundServer, Server
from hcloud.ssh_keys import SSHKey

from catacloud.agent.backoff import backoff
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

# Hetzner error code -> our typed error (https://docs.hetzner.cloud/#errors).
ERROR_CODES: Mapping[str, type[ProviderError]] = {
    "rate_limit_exceeded": RateLimited,
    "resource_unavailable": InsufficientCapacity,
    "placement_error": InsufficientCapacity,
    "resource_limit_exceeded": QuotaExceeded,
    "not_found": NotFound,
    "server_error": Transient,
    "unavailable": Transient,
    "timeout": Transient,
    "conflict": Transient,
    "bad_gateway": Transient,
    "maintenance": Transient,
    "locked": Transient,
    "service_error": Transient,
    "unauthorized": Permanent,
    "token_readonly": Permanent,
    "forbidden": Permanent,
    "invalid_input": Permanent,
    "json_error": Permanent,
    "unsupported_error": Permanent,
    "uniqueness_error": Permanent,
    "protected": Permanent,
    "method_not_allowed": Permanent,
    "deprecated_api_endpoint": Permanent,
}

# Label syntax (https://docs.hetzner.cloud/#labels); checked so a selector cannot be widened.
_LABEL_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^(?:[a-z0-9](?:[a-z0-9.-]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^(?:{_LABEL_NAME})?$")


def map_error(exc: BaseException, *, retry_after: float | None = None) -> ProviderError:
    """Translate an hcloud/requests exception into the provider error hierarchy."""
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, APIException):
        message = f"hetzner: {exc.message} ({exc.code})"
        if isinstance(exc.code, str):
            cls = ERROR_CODES.get(exc.code, Permanent)
        elif exc.code == 429:
            cls = RateLimited
        elif exc.code == 404:
            cls = NotFound
        elif exc.code >= 500:
            cls = Transient
        else:
            cls = Permanent
        return cls(message, retry_after=retry_after if cls is RateLimited else None)
    if isinstance(exc, requests.RequestException | HCloudException):
        # Timeouts, refused or dropped connections, actions still running after polling.
        return Transient(f"hetzner: {type(exc).__name__}: {exc}")
    return Permanent(f"hetzner: unexpected {type(exc).__name__}: {exc}")


def _ref(cls: Any, value: str | int) -> Any:
    """``ServerType(id=1)`` for numeric references, ``ServerType(name="cx23")`` otherwise."""
    text = str(value)
    return cls(id=int(text)) if text.isdigit() else cls(name=text)


class HetznerProvider(Provider):
    kind = "hetzner"
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = {
        "initializing": MachineState.PROVISIONING,
        "starting": MachineState.PROVISIONING,
        "rebuilding": MachineState.PROVISIONING,
        "running": MachineState.RUNNING,
        "migrating": MachineState.RUNNING,  # live migration: the machine keeps running
        "stopping": MachineState.STOPPING,
        "off": MachineState.STOPPING,  # still billed; we never power off, so it is on its way out
        "deleting": MachineState.STOPPING,
        "unknown": MachineState.UNKNOWN,
    }

    checks_offerings = True

    def __init__(self, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> None:
        super().__init__(config=config, credentials=credentials)
        token = self.credentials.get("token")
        if not token:
            raise Permanent("hetzner provider needs credential 'token'")
        cfg = self.config
        self.location = str(cfg.get("location", ""))
        self.ssh_keys = [_ref(SSHKey, k) for k in cfg.get("ssh_keys") or ()]
        self.networks = [Network(id=int(cfg["network"]))] if cfg.get("network") else []
        self.retry_attempts = int(cfg.get("retry_attempts", 4))
        self.retry_backoff = float(cfg.get("retry_backoff", 1.0))
        self.retry_max_delay = float(cfg.get("retry_max_delay", 30.0))
        client_kwargs: dict[str, Any] = {}
        if cfg.get("api_endpoint"):
            client_kwargs["api_endpoint"] = str(cfg["api_endpoint"]).rstrip("/")
        self.client = Client(
            token=token,
            application_name="catacloud",
            poll_interval=float(cfg.get("poll_interval", 1.0)),
            poll_max_retries=int(cfg.get("poll_max_retries", 120)),
            timeout=float(cfg.get("timeout", 30.0)),
            **client_kwargs,
        )
        self._local = threading.local()
        # hcloud exposes no setting for its retry policy; turn it off (see module docstring)
        # and watch responses for Retry-After / RateLimit-Remaining.
        base = getattr(self.client, "_client", None)
        if base is not None:
            if hasattr(base, "_retry_max_retries"):
                base._retry_max_retries = 0
            if hasattr(base, "_session"):
                base._session.hooks["response"].append(self._on_response)

    # ---- the interface ------------------------------------------------------------------------

    def create(self, spec: MachineSpec) -> ProviderMachine:
        labels = self._labels(spec)
        server, action = self._retrying(lambda: self._create_or_adopt(spec, labels))
        if action is not None:
            actions = [action]
        elif server.status in ("initializing", "starting"):
            # Adopted while still booting: wait for its running actions like a fresh create would.
            actions = self._retrying(
                lambda: self.client.servers.get_actions_list(server, status=["running"]).actions
            )
        else:
            actions = []
        for pending in actions:
            failure = self._retrying(functools.partial(_wait, pending))
            if failure is not None:
                # The server exists but did not come up: remove it, report by the action's error.
                with contextlib.suppress(ProviderError):  # else the reconciler deletes it later
                    self._delete(_server_id(server))
                code = str(failure.get("code", ""))
                cls = ERROR_CODES.get(code, Transient)
                raise cls(f"hetzner: creating {spec.name} failed: {failure.get('message', '')} ({code})")
        if actions:
            server_id = _server_id(server)
            server = self._retrying(lambda: self.client.servers.get_by_id(server_id))
        return self._machine(server)

    def get(self, provider_id: str) -> ProviderMachine:
        try:
            server_id = int(provider_id)
        except ValueError:
            raise NotFound(f"hetzner: no server {provider_id!r}") from None
        return self._machine(self._retrying(lambda: self.client.servers.get_by_id(server_id)))

    def list(self, owner_labels: Mapping[str, str]) -> list[ProviderMachine]:
        self._check_labels(owner_labels)
        selector = ",".join(f"{k}={v}" for k, v in sorted(owner_labels.items())) or None
        servers = self._retrying(lambda: self.client.servers.get_all(label_selector=selector))
        return [self._machine(s) for s in servers]

    def delete(self, provider_id: str) -> None:
        try:
            server_id = int(provider_id)
        except ValueError:
            return  # not a Hetzner id: nothing there to delete
        self._delete(server_id)

    def check_offerings(self, offerings: Sequence[Offering]) -> Sequence[OfferingProblem]:
        """Each offering against Hetzner's lists: ``GET /server_types``, ``/images`` and
        ``/locations`` (each paged, once). A server type whose deprecation's ``unavailable_after``
        has passed is gone from the list and refused in new servers (docs.hetzner.cloud,
        "Deprecation"); a server type is sold only at the locations its ``locations`` names
        (changelog 2025-09-24, per-location server types), each with its own deprecation."""
        types = self._retrying(lambda: self.client.server_types.get_all())
        images = self._retrying(lambda: self.client.images.get_all(include_deprecated=True))
        locations = self._retrying(lambda: self.client.locations.get_all())
        catalog = _Catalog(
            types={str(ref): t for t in types for ref in (t.name, t.id) if ref is not None},
            images=images,
            locations={str(loc.name) for loc in locations},
            now=datetime.now(UTC),
        )
        return [p for o in offerings for p in catalog.problems(o, o.location or self.location)]

    # ---- helpers ------------------------------------------------------------------------------

    def _create_or_adopt(
        self, spec: MachineSpec, labels: dict[str, str]
    ) -> tuple[BoundServer, BoundAction | None]:
        location = spec.location or self.location
        try:
            response = self.client.servers.create(
                name=spec.name,
                server_type=_ref(ServerType, spec.server_type),
                image=_ref(Image, spec.image),
                location=_ref(Location, location) if location else None,
                ssh_keys=self.ssh_keys or None,
                networks=self.networks or None,
                user_data=spec.cloud_init or None,
                labels=labels,
            )
            return response.server, response.action
        except APIException as exc:
            if exc.code != "uniqueness_error":
                raise
        # The name exists: an earlier attempt (perhaps one whose response was lost) created it.
        server = self.client.servers.get_by_name(spec.name)
        if server is None:
            raise Transient(f"hetzner: {spec.name} was reported taken but is gone; retry")
        if (server.labels or {}).get(LABEL_INSTANCE) != spec.instance_id:
            raise Permanent(f"hetzner: server name {spec.name} is taken by a server that is not ours")
        if self.map_state(server.status or "unknown") is MachineState.STOPPING:
            # Left over by a failed attempt (its create action failed, or it was powered off):
            # never hand that out. Remove it so the retry creates a fresh server.
            self._delete(_server_id(server))
            raise Transient(f"hetzner: removed broken leftover {spec.name} ({server.status}); retry")
        return server, None

    def _delete(self, server_id: int) -> None:
        with contextlib.suppress(NotFound):  # already gone: done
            self._retrying(lambda: self.client.servers.delete(Server(id=server_id)))

    def _retrying(self, fn: Callable[[], T]) -> T:
        """Call ``fn``; retry rate limits and transient failures with bounded backoff."""
        for attempt in itertools.count():
            self._local.retry_after = None
            try:
                return fn()
            except ProviderError as err:
                if not self._should_retry(err, attempt):
                    raise
                error = err
            except ActionTimeoutException as exc:
                # Polling already waited poll_max_retries; the server stays and will be adopted.
                raise Transient(f"hetzner: action still running after polling: {exc}") from exc
            except (HCloudException, requests.RequestException) as exc:
                error = map_error(exc, retry_after=self._local.retry_after)
                if not self._should_retry(error, attempt):
                    raise error from exc
            time.sleep(
                backoff(
                    attempt,
                    base=self.retry_backoff,
                    cap=self.retry_max_delay,
                    hint=error.retry_after,
                    jitter=(1.0, 1.0),
                )
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def _should_retry(self, error: ProviderError, attempt: int) -> bool:
        return isinstance(error, RateLimited | Transient) and attempt < self.retry_attempts

    def _on_response(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        if response.status_code != 429:
            return
        retry_after: float | None = None
        try:
            if "Retry-After" in response.headers:
                retry_after = float(response.headers["Retry-After"])
            elif response.headers.get("RateLimit-Remaining") == "0":
                retry_after = 1.0  # the budget refills by one request per second
        except ValueError:
            retry_after = None
        self._local.retry_after = retry_after

    def _labels(self, spec: MachineSpec) -> dict[str, str]:
        labels = {**spec.labels, LABEL_INSTANCE: spec.instance_id}
        if spec.labels.get(LABEL_INSTANCE, spec.instance_id) != spec.instance_id:
            raise Permanent(f"label {LABEL_INSTANCE} disagrees with the spec's instance id")
        self._check_labels(labels)
        return labels

    @staticmethod
    def _check_labels(labels: Mapping[str, str]) -> None:
        for key, value in labels.items():
            if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
                raise Permanent(f"hetzner: invalid label {key!r}={value!r}")

    def _machine(self, server: BoundServer) -> ProviderMachine:
        public_net = server.public_net
        ipv4 = public_net.ipv4 if public_net is not None else None
        private = server.private_net or []
        raw = server.status or "unknown"
        return ProviderMachine(
            provider_id=str(server.id),
            name=server.name or "",
            state=self.map_state(raw),
            labels=dict(server.labels or {}),
            created_at=server.created,
            public_ip=ipv4.ip if ipv4 is not None else "",
            private_ip=private[0].ip if private else "",
            raw_state=raw,
        )


@dataclasses.dataclass(frozen=True)
class _Catalog:
    """What one Hetzner project may buy now, from the three lists; judges offerings."""

    types: dict[str, BoundServerType]  # by name and by id
    images: list[BoundImage]
    locations: set[str]
    now: datetime

    def problems(self, offering: Offering, location: str) -> list[OfferingProblem]:
        found: list[OfferingProblem] = []

        def say(message: str, refused: bool = True) -> None:
            found.append(OfferingProblem(offering, f"hetzner: {message}", refused))

        server_type = self.types.get(offering.server_type)
        if server_type is None:
            sold = sorted({str(t.name) for t in self.types.values()})
            say(f"no server type {offering.server_type!r} is sold (sold: {', '.join(sold)})")
        if location and location not in self.locations:
            say(f"no location {location!r} (locations: {', '.join(sorted(self.locations))})")
            location = ""
        images = [i for i in self.images if offering.image in (i.name, str(i.id))]
        if not images:
            say(f"no image {offering.image!r}")
        elif server_type is not None and not any(i.architecture == server_type.architecture for i in images):
            say(f"image {offering.image!r} has no {server_type.architecture} build for {server_type.name}")
        elif all(i.deprecation is not None for i in images):
            say(f"image {offering.image!r} is deprecated{_until(images[0].deprecation)}", refused=False)
        if server_type is not None and offering.arch:
            # The API names x86 and arm (docs.hetzner.cloud, Server Types: "architecture").
            named = str(server_type.architecture)
            actual = {"x86": "x86_64", "arm": "arm64"}.get(named, named)
            if actual != offering.arch:
                say(
                    f"server type {server_type.name} is {actual}, "
                    f"not {offering.arch} as its machine type says"
                )
        if server_type is not None and location:
            self._at_location(server_type, location, say)
        return found

    def _at_location(self, server_type: BoundServerType, location: str, say: Callable[..., None]) -> None:
        entries = {e.location.name: e for e in server_type.locations or []}
        entry = entries.get(location)
        if entry is None:
            where = ", ".join(sorted(str(name) for name in entries)) or "nowhere"
            say(f"server type {server_type.name} is not sold at {location} (sold at: {where})")
        elif entry.deprecation is not None:
            gone = entry.deprecation.unavailable_after
            if gone is not None and gone <= self.now:
                say(f"server type {server_type.name} is no longer sold at {location} (since {gone:%Y-%m-%d})")
            else:
                until = _until(entry.deprecation)
                say(f"server type {server_type.name} is deprecated at {location}{until}", refused=False)
        elif entry.available is False:
            say(f"server type {server_type.name} is sold out at {location} right now", refused=False)


def _until(deprecation: DeprecationInfo | None) -> str:
    gone = deprecation.unavailable_after if deprecation is not None else None
    return f": sold until {gone:%Y-%m-%d}, pick its successor" if gone is not None else ""


def _wait(action: BoundAction) -> dict[str, Any] | None:
    """Poll ``action`` until it ends; return its error (a dict) if it failed, else ``None``."""
    try:
        action.wait_until_finished()
    except ActionFailedException as exc:
        return dict(exc.action.error or {"code": "action_failed", "message": "action failed"})
    return None


def _server_id(server: Any) -> int:
    """A server the API returned always has an id (hcloud types it as optional)."""
    if server.id is None:
        raise Transient("hetzner: a server without an id in the API's answer")
    return int(server.id)
