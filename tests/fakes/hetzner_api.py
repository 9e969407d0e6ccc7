"""A stateful fake of the Hetzner Cloud API (https://docs.hetzner.cloud), enough for hcloud-python.

A small werkzeug WSGI app served on a loopback port from a background thread::

    fake = FakeHetzner(token="t").start()      # fake.url -> "http://127.0.0.1:PORT/v1"
    fake.fail_next("POST /servers", "rate_limit", times=2)
    fake.fail_next("POST /servers", "drop_after")   # create the server, then drop the connection
    ...
    fake.stop()

Endpoints: ``GET/POST /servers``, ``GET/DELETE /servers/{id}``, ``GET /servers/{id}/actions[/{id}]``,
``GET /actions/{id}``, ``GET /server_types``, ``/images``, ``/locations``. Errors use the
documented body ``{"error": {"code", "message", "details"}}``. Create actions stay ``running``
for ``action_polls`` GETs, then end in ``success`` (the server becomes ``running``) or in
``error`` when injected with :meth:`fail_next_action`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

# Fault kinds for fail_next(): kind -> (HTTP status, error code, message), or a transport fault.
ERRORS: dict[str, tuple[int, str, str]] = {
    "invalid_input": (422, "invalid_input", "invalid input in field 'name'"),
    "rate_limit": (429, "rate_limit_exceeded", "limit of 3600 requests per hour reached"),
    "resource_unavailable": (412, "resource_unavailable", "server type unavailable in this location"),
    "resource_limit_exceeded": (403, "resource_limit_exceeded", "server limit exceeded"),
    "unauthorized": (401, "unauthorized", "unable to authenticate"),
    "server_error": (500, "server_error", "internal server error"),
    "unavailable": (503, "unavailable", "service unavailable"),
}
# 502/504 come from the load balancer in front of the API: HTML bodies, no JSON error.
GATEWAY_ERRORS = {"bad_gateway": (502, "Bad Gateway"), "gateway_timeout": (504, "Gateway Timeout")}
# drop_before: close the connection without acting; drop_after: act, then close without answering;
# stall: act, answer only after ``stall_seconds`` (longer than the client's timeout).
TRANSPORT_FAULTS = ("drop_before", "drop_after", "stall")
FAULT_KINDS = (*ERRORS, *GATEWAY_ERRORS, *TRANSPORT_FAULTS)

# The catalog lists as the API answers them today (docs.hetzner.cloud: "Server Types", "Images",
# "Locations"); ids are made up. Since 2025-09-24 a server type names the locations it is sold at,
# each with a deprecation of its own (changelog "per-location server types"); the top-level
# ``deprecation`` is being phased out for it, and the ``deprecated`` fields of server types and
# images were removed (changelog 2026-09-08, "removing the deprecated field"). A deprecation is
# ``{"announced", "unavailable_after"}``: after ``unavailable_after`` the resource is gone from the
# general list and cannot be used in new resources (docs.hetzner.cloud, "Deprecation").
# cx22 (and the rest of CX Gen 2) was deprecated on 2025-10-16 and left the API at the end of 2025
# (changelog 2025-10-16 "server types deprecated"; hetznercloud/packer-plugin-hcloud#317): cx23 and
# cx33 (cost-optimized, EU locations only) replace it. ccx13 (dedicated vCPU) is sold in the US too.
_EU = ("fsn1", "nbg1", "hel1")
_CX22_GONE = {"announced": "2025-10-16T00:00:00+00:00", "unavailable_after": "2026-01-01T00:00:00+00:00"}
SERVER_TYPES: list[dict[str, Any]] = [
    {"id": 22, "name": "cx22", "description": "CX22", "cores": 2, "memory": 4.0, "disk": 40,
     "cpu_type": "shared", "category": "cost_optimized", "deprecation": _CX22_GONE,
     "locations": [{"name": n, "deprecation": _CX22_GONE} for n in _EU]},
    {"id": 104, "name": "cx23", "description": "CX23", "cores": 2, "memory": 4.0, "disk": 40,
     "cpu_type": "shared", "category": "cost_optimized", "locations": [{"name": n} for n in _EU]},
    {"id": 105, "name": "cx33", "description": "CX33", "cores": 4, "memory": 8.0, "disk": 80,
     "cpu_type": "shared", "category": "cost_optimized", "locations": [{"name": n} for n in _EU]},
    {"id": 96, "name": "ccx13", "description": "CCX13", "cores": 2, "memory": 8.0, "disk": 80,
     "cpu_type": "dedicated", "category": "dedicated_cpu",
     "locations": [{"name": n} for n in (*_EU, "ash")]},
]  # fmt: skip
IMAGES: list[dict[str, Any]] = [
    {"id": 161547269, "name": "ubuntu-24.04", "description": "Ubuntu 24.04", "os_flavor": "ubuntu",
     "os_version": "24.04", "architecture": "x86"},
    {"id": 114690389, "name": "debian-12", "description": "Debian 12", "os_flavor": "debian",
     "os_version": "12", "architecture": "x86"},
]  # fmt: skip
LOCATIONS = [
    {"id": 1, "name": "fsn1", "city": "Falkenstein", "country": "DE", "network_zone": "eu-central"},
    {"id": 2, "name": "nbg1", "city": "Nuremberg", "country": "DE", "network_zone": "eu-central"},
    {"id": 3, "name": "hel1", "city": "Helsinki", "country": "FI", "network_zone": "eu-central"},
    {"id": 4, "name": "ash", "city": "Ashburn, VA", "country": "US", "network_zone": "us-east"},
]

_NAME = re.compile(r"^(?=.{1,63}$)[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?$")
_LABEL_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^(?:[a-z0-9](?:[a-z0-9.-]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^(?:{_LABEL_NAME})?$")
_SERVER_PATH = re.compile(r"^/servers/(\d+)$")
_SERVER_ACTIONS_PATH = re.compile(r"^/servers/(\d+)/actions$")
_SERVER_ACTION_PATH = re.compile(r"^/servers/(\d+)/actions/(\d+)$")
_ACTION_PATH = re.compile(r"^/actions/(\d+)$")
_ID_SEGMENT = re.compile(r"/\d+")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, details: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, dict(details or {})


class _Drop(ConnectionResetError):
    """Raised inside the app to make werkzeug close the connection without writing a response."""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# ---- label selectors ------------------------------------------------------------------------------


def _split_selector(selector: str) -> list[str]:
    """Split on commas that are not inside ``( )``."""
    parts, depth, current = [], 0, []
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts]


_SET_EXPR = re.compile(r"^(\S+)\s+(in|notin)\s+\(([^()]*)\)$")
_EQ_EXPR = re.compile(r"^([^\s!=]+)\s*(==|!=|=)\s*([^\s!=,()]*)$")
_NOT_EXPR = re.compile(r"^!\s*([^\s!=,()]+)$")
_HAS_EXPR = re.compile(r"^([^\s!=,()]+)$")


def parse_label_selector(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """Compile a label selector: ``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (..)``, ``k notin (..)``."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    for expr in _split_selector(selector):
        if m := _SET_EXPR.match(expr):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                tests.append(lambda labels, k=key, vs=values: k in labels and labels[k] in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif m := _EQ_EXPR.match(expr):
            key, op, value = m.groups()
            if op == "!=":
                tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif m := _NOT_EXPR.match(expr):
            key = m.group(1)
            tests.append(lambda labels, k=key: k not in labels)
        elif m := _HAS_EXPR.match(expr):
            key = m.group(1)
            tests.append(lambda labels, k=key: k in labels)
        else:
            raise ApiError(
                422,
                "invalid_input",
                f"invalid label_selector: {expr!r}",
                {"fields": [{"name": "label_selector", "messages": ["invalid selector"]}]},
            )
    return lambda labels: all(test(labels) for test in tests)


# ---- the fake -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Fault:
    kind: str
    retry_after: float | None = None


@dataclasses.dataclass
class _Action:
    id: int
    command: str
    server_id: int
    polls_left: int
    outcome: str = "success"  # or "error"
    error: dict[str, str] | None = None
    started: str = dataclasses.field(default_factory=_now)
    finished: str | None = None

    @property
    def status(self) -> str:
        return "running" if self.polls_left > 0 else self.outcome

    def as_json(self) -> dict[str, Any]:
        done = self.polls_left <= 0
        return {
            "id": self.id,
            "command": self.command,
            "status": self.status,
            "progress": 100 if done else 50,
            "started": self.started,
            "finished": self.finished if done else None,
            "resources": [{"id": self.server_id, "type": "server"}],
            "error": self.error if done and self.outcome == "error" else None,
        }


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def log_error(self, format: str, *args: Any) -> None:
        pass


class FakeHetzner:
    """The fake API. Thread-safe; ``requests`` records ``(method, path, status)`` of every call."""

    def __init__(
        self,
        *,
        token: str = "test-token",
        action_polls: int = 1,
        stall_seconds: float = 1.0,
        server_limit: int | None = None,
        port: int = 0,
    ) -> None:
        self.token = token
        self.port = port
        self.action_polls = action_polls
        self.stall_seconds = stall_seconds
        self.server_limit = server_limit
        self._lock = threading.RLock()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.reset()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FakeHetzner:
        self._server = make_server(
            "127.0.0.1", self.port, self._wsgi, threaded=True, request_handler=_QuietHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hetzner", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHetzner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_port}/v1"

    def reset(self) -> None:
        """Forget servers, actions, faults and the request log (settings stay)."""
        with self._lock:
            self.servers: dict[int, dict[str, Any]] = {}
            self.user_data: dict[int, str] = {}
            self.actions: dict[int, _Action] = {}
            self.requests: list[tuple[str, str, int]] = []
            self.created_names: list[str] = []  # every successful create, in order
            self.server_types: list[dict[str, Any]] = copy.deepcopy(SERVER_TYPES)
            self._faults: dict[str, deque[_Fault]] = {}
            self._action_faults: deque[dict[str, str]] = deque()
            self._ids = itertools.count(1000)
            self.sold_out: set[tuple[str, str]] = set()  # (server type, location) with no capacity
            self.capacity_refusals: list[tuple[str, str, float]] = []  # each refused create, when
            self.creates: list[tuple[str, str, float]] = []  # each server made: type, location, when

    # ---- test controls ------------------------------------------------------------------------

    def fail_next(
        self, endpoint: str, kind: str, *, times: int = 1, retry_after: float | None = None
    ) -> None:
        """Make the next ``times`` requests to ``endpoint`` fail with ``kind``.

        ``endpoint`` is ``"METHOD /path"`` with ``{id}`` for ids, e.g. ``"POST /servers"``,
        ``"GET /servers/{id}"``, ``"DELETE /servers/{id}"``, ``"GET /actions/{id}"``.
        ``kind`` is one of :data:`FAULT_KINDS`. ``retry_after`` adds a Retry-After header (429).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}")
        with self._lock:
            self._faults.setdefault(endpoint, deque()).extend(_Fault(kind, retry_after) for _ in range(times))

    def sell_out(self, server_type: str, location: str, *, sold_out: bool = True) -> None:
        """Every create of ``server_type`` at ``location`` fails with ``resource_unavailable``
        until restocked (``sold_out=False``), as a location out of a server type answers (Hetzner
        Cloud API "Errors": ``resource_unavailable``, "the requested resource is currently
        unavailable"); other types and locations are unaffected."""
        with self._lock:
            (self.sold_out.add if sold_out else self.sold_out.discard)((server_type, location))

    def fail_next_action(self, code: str = "server_create_failed", message: str = "could not create") -> None:
        """The next create action ends in ``error`` instead of ``success``."""
        with self._lock:
            self._action_faults.append({"code": code, "message": message})

    def deprecate(
        self, server_type: str, *, unavailable_after: datetime, location: str | None = None
    ) -> None:
        """Announce (now) that ``server_type`` leaves ``location`` (every location: ``None``) after
        ``unavailable_after``; past that moment it is gone from the list, as a real one is."""
        deprecation = {"announced": _now(), "unavailable_after": unavailable_after.isoformat()}
        with self._lock:
            kind = next(t for t in self.server_types if t["name"] == server_type)
            for entry in kind["locations"]:
                if location in (None, entry["name"]):
                    entry["deprecation"] = deprecation
            if location is None:
                kind["deprecation"] = deprecation

    def pending_faults(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._faults.values()) + len(self._action_faults)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._action_faults.clear()

    def add_server(self, name: str, labels: Mapping[str, str] | None = None, status: str = "running") -> int:
        """Put a server straight into the project (no action), e.g. to test listing."""
        with self._lock:
            server = self._new_server(name, "cx23", "ubuntu-24.04", "fsn1", dict(labels or {}))
            server["status"] = status
            return server["id"]

    def count(self, method: str, path_prefix: str) -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.requests if m == method and p.startswith(path_prefix))

    # ---- WSGI ---------------------------------------------------------------------------------

    def _wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = Request(environ)
        path = request.path.removeprefix("/v1")
        endpoint = f"{request.method} {_ID_SEGMENT.sub('/{id}', path)}"
        with self._lock:
            queue = self._faults.get(endpoint)
            fault = queue.popleft() if queue else None
        try:
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                raise ApiError(401, "unauthorized", "unable to authenticate")
            if fault is not None and fault.kind == "drop_before":
                self._drop(environ)
            if fault is not None and fault.kind in ERRORS:
                status, code, message = ERRORS[fault.kind]
                raise ApiError(status, code, message)
            if fault is not None and fault.kind in GATEWAY_ERRORS:
                status, reason = GATEWAY_ERRORS[fault.kind]
                response = Response(
                    f"<html><body><h1>{status} {reason}</h1></body></html>", status, mimetype="text/html"
                )
            else:
                status, body = self._route(request, path)
                response = Response(json.dumps(body), status, mimetype="application/json")
        except ApiError as err:
            body = {"error": {"code": err.code, "message": err.message, "details": err.details}}
            response = Response(json.dumps(body), err.status, mimetype="application/json")
            if err.status == 429:
                response.headers.update(
                    {
                        "RateLimit-Limit": "3600",
                        "RateLimit-Remaining": "0",
                        "RateLimit-Reset": str(int(time.time()) + 1),
                    }
                )
                if fault is not None and fault.retry_after is not None:
                    response.headers["Retry-After"] = str(fault.retry_after)
        with self._lock:
            self.requests.append((request.method, path, response.status_code))
        if fault is not None and fault.kind == "drop_after":
            self._drop(environ)
        if fault is not None and fault.kind == "stall":
            time.sleep(self.stall_seconds)
        return response(environ, start_response)

    @staticmethod
    def _drop(environ: Mapping[str, Any]) -> None:
        sock: socket.socket = environ["werkzeug.socket"]
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        raise _Drop("connection dropped by fault injection")

    def _route(self, request: Request, path: str) -> tuple[int, dict[str, Any]]:
        method = request.method
        with self._lock:
            if path == "/servers" and method == "GET":
                return 200, self._list_servers(request)
            if path == "/servers" and method == "POST":
                return 201, self._create_server(request)
            if m := _SERVER_PATH.match(path):
                server_id = int(m.group(1))
                if method == "GET":
                    return 200, {"server": self._server_json(self._get_server(server_id))}
                if method == "DELETE":
                    return 200, {"action": self._delete_server(server_id)}
            if (m := _ACTION_PATH.match(path)) and method == "GET":
                return 200, {"action": self._poll_action(int(m.group(1)))}
            if (m := _SERVER_ACTIONS_PATH.match(path)) and method == "GET":
                server_id = int(m.group(1))
                self._get_server(server_id)
                statuses = request.args.getlist("status")
                actions = [
                    a.as_json()
                    for a in sorted(self.actions.values(), key=lambda a: a.id)
                    if a.server_id == server_id and (not statuses or a.status in statuses)
                ]
                return 200, self._page(request, "actions", actions)
            if (m := _SERVER_ACTION_PATH.match(path)) and method == "GET":
                self._get_server(int(m.group(1)))
                return 200, {"action": self._poll_action(int(m.group(2)))}
            if path in ("/server_types", "/images", "/locations") and method == "GET":
                return 200, self._page(request, path.strip("/"), self._catalog(path, request))
        raise ApiError(404, "not_found", f"{method} {path} not found")

    # ---- the catalog lists (called with the lock held) ----------------------------------------

    def _catalog(self, path: str, request: Request) -> list[dict[str, Any]]:
        """``GET /server_types`` (``name``), ``/images`` (``name``, ``type``, ``architecture``,
        ``include_deprecated``: deprecated images are left out unless it is true) and ``/locations``
        (``name``), as documented; a server type past its ``unavailable_after`` is not listed."""
        args = request.args
        if path == "/server_types":
            items = [self._server_type_json(t) for t in self._sold_types()]
        elif path == "/locations":
            items = list(LOCATIONS)
        else:
            items = [_image_json(i) for i in IMAGES]
            if args.get("include_deprecated", "false").lower() != "true":
                items = [i for i in items if i["deprecation"] is None]
            for key in ("type", "architecture"):
                if wanted := args.getlist(key):
                    items = [i for i in items if i[key] in wanted]
        return [i for i in items if args.get("name") in (None, i["name"])]

    def _sold_types(self) -> list[dict[str, Any]]:
        """Server types still in the list: not every location's deprecation has passed."""
        return [t for t in self.server_types if not all(_gone(e.get("deprecation")) for e in t["locations"])]

    @staticmethod
    def _server_type_json(kind: Mapping[str, Any]) -> dict[str, Any]:
        locations = []
        for entry in kind["locations"]:
            location = next(loc for loc in LOCATIONS if loc["name"] == entry["name"])
            deprecation = entry.get("deprecation")
            locations.append(
                {
                    "id": location["id"],
                    "name": location["name"],
                    "deprecation": deprecation,
                    "available": not _gone(deprecation),
                    "recommended": deprecation is None,
                }
            )
        return {
            **{k: v for k, v in kind.items() if k != "locations"},
            "deprecation": kind.get("deprecation"),
            "storage_type": "local",
            "architecture": "x86",
            "prices": [],
            "locations": locations,
        }

    # ---- resources (called with the lock held) ------------------------------------------------

    def _list_servers(self, request: Request) -> dict[str, Any]:
        servers = sorted(self.servers.values(), key=lambda s: s["id"])
        if name := request.args.get("name"):
            servers = [s for s in servers if s["name"] == name]
        if selector := request.args.get("label_selector"):
            matches = parse_label_selector(selector)
            servers = [s for s in servers if matches(s["labels"])]
        if statuses := request.args.getlist("status"):
            servers = [s for s in servers if s["status"] in statuses]
        return self._page(request, "servers", [self._server_json(s) for s in servers])

    @staticmethod
    def _page(request: Request, key: str, items: list[Any]) -> dict[str, Any]:
        try:
            page = int(request.args.get("page", 1))
            per_page = int(request.args.get("per_page", 25))
        except ValueError:
            raise ApiError(422, "invalid_input", "page and per_page must be integers") from None
        if page < 1 or not 1 <= per_page <= 50:
            raise ApiError(422, "invalid_input", "page must be >= 1 and per_page between 1 and 50")
        last_page = max(1, math.ceil(len(items) / per_page))
        return {
            key: items[(page - 1) * per_page : page * per_page],
            "meta": {
                "pagination": {
                    "page": page,
                    "per_page": per_page,
                    "previous_page": page - 1 if page > 1 else None,
                    "next_page": page + 1 if page < last_page else None,
                    "last_page": last_page,
                    "total_entries": len(items),
                }
            },
        }

    def _create_server(self, request: Request) -> dict[str, Any]:
        try:
            data = json.loads(request.get_data() or b"null")
        except ValueError:
            raise ApiError(400, "json_error", "invalid JSON input") from None
        if not isinstance(data, dict):
            raise ApiError(400, "json_error", "expected a JSON object")
        name, labels = data.get("name"), data.get("labels") or {}
        invalid = []
        if not isinstance(name, str) or not _NAME.match(name):
            invalid.append("name")
        # A server type gone from the list "can not be used in new resources" (docs.hetzner.cloud,
        # Deprecation): refused like a name that never existed.
        if not _find(self._sold_types(), data.get("server_type")):
            invalid.append("server_type")
        if not _find(IMAGES, data.get("image")):
            invalid.append("image")
        if "location" in data and not _find(LOCATIONS, data["location"]):
            invalid.append("location")
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and _LABEL_KEY.match(k) and _LABEL_VALUE.match(v)
            for k, v in labels.items()
        ):
            invalid.append("labels")
        if len(data.get("user_data") or "") > 32 * 1024:
            invalid.append("user_data")
        if invalid:
            raise ApiError(
                422,
                "invalid_input",
                f"invalid input in field '{invalid[0]}'",
                {"fields": [{"name": f, "messages": ["is invalid"]} for f in invalid]},
            )
        if any(s["name"] == name for s in self.servers.values()):
            raise ApiError(
                409, "uniqueness_error", "server name is already used", {"fields": [{"name": "name"}]}
            )
        location = data.get("location", "fsn1")
        if (data["server_type"], location) in self.sold_out:
            self.capacity_refusals.append((data["server_type"], location, time.time()))
            status, code, _ = ERRORS["resource_unavailable"]
            raise ApiError(status, code, f"server type {data['server_type']} is unavailable in {location}")
        if self.server_limit is not None and len(self.servers) >= self.server_limit:
            raise ApiError(
                403,
                "resource_limit_exceeded",
                "server limit exceeded",
                {"limits": [{"name": "server_limit"}]},
            )
        server = self._new_server(
            name, data["server_type"], data["image"], data.get("location", "fsn1"), labels
        )
        self.user_data[server["id"]] = data.get("user_data") or ""
        self.created_names.append(name)
        self.creates.append((data["server_type"], location, time.time()))
        action = _Action(next(self._ids), "create_server", server["id"], self.action_polls)
        if self._action_faults:
            action.outcome, action.error = "error", self._action_faults.popleft()
        if action.polls_left <= 0:
            self._finish(action)
        self.actions[action.id] = action
        return {
            "server": self._server_json(server),
            "action": action.as_json(),
            "next_actions": [],
            "root_password": None if data.get("ssh_keys") else "fake-root-password",
        }

    def _new_server(
        self, name: str, server_type: Any, image: Any, location: Any, labels: dict
    ) -> dict[str, Any]:
        server_id = next(self._ids)
        server = {
            "id": server_id,
            "name": name,
            "status": "initializing",
            "created": _now(),
            "labels": dict(labels),
            "server_type": _find(self.server_types, server_type),
            "image": _find(IMAGES, image),
            "location": _find(LOCATIONS, location),
        }
        self.servers[server_id] = server
        return server

    def _get_server(self, server_id: int) -> dict[str, Any]:
        try:
            return self.servers[server_id]
        except KeyError:
            raise ApiError(404, "not_found", f"server with ID '{server_id}' not found") from None

    def _delete_server(self, server_id: int) -> dict[str, Any]:
        self._get_server(server_id)
        del self.servers[server_id]
        action = _Action(next(self._ids), "delete_server", server_id, 0)
        action.finished = _now()
        self.actions[action.id] = action
        return action.as_json()

    def _poll_action(self, action_id: int) -> dict[str, Any]:
        action = self.actions.get(action_id)
        if action is None:
            raise ApiError(404, "not_found", f"action with ID '{action_id}' not found")
        if action.polls_left > 0:
            action.polls_left -= 1
            if action.polls_left == 0:
                self._finish(action)
        return action.as_json()

    def _finish(self, action: _Action) -> None:
        action.finished = _now()
        server = self.servers.get(action.server_id)
        if server is not None and action.command == "create_server":
            server["status"] = "running" if action.outcome == "success" else "off"

    def _server_json(self, server: Mapping[str, Any]) -> dict[str, Any]:
        sid = server["id"]
        ip = f"198.51.{sid // 256 % 256}.{sid % 256}"
        location = server["location"]
        return {
            "id": sid,
            "name": server["name"],
            "status": server["status"],
            "created": server["created"],
            "public_net": {
                "ipv4": {
                    "id": sid + 1_000_000,
                    "ip": ip,
                    "blocked": False,
                    "dns_ptr": f"static.{ip}.example",
                },
                "ipv6": {
                    "id": sid + 2_000_000,
                    "ip": f"2001:db8:{sid:x}::/64",
                    "blocked": False,
                    "dns_ptr": [],
                },
                "floating_ips": [],
                "firewalls": [],
            },
            "private_net": [],
            "server_type": self._server_type_json(server["server_type"]),
            "location": location,
            "image": _image_json(server["image"]),
            "iso": None,
            "rescue_enabled": False,
            "locked": False,
            "backup_window": None,
            "outgoing_traffic": 0,
            "ingoing_traffic": 0,
            "included_traffic": 21990232555520,
            "protection": {"delete": False, "rebuild": False},
            "labels": dict(server["labels"]),
            "volumes": [],
            "load_balancers": [],
            "primary_disk_size": server["server_type"]["disk"],
            "placement_group": None,
        }


def _gone(deprecation: Mapping[str, str] | None) -> bool:
    """Whether a deprecation's ``unavailable_after`` has passed."""
    if not deprecation:
        return False
    return datetime.fromisoformat(deprecation["unavailable_after"]) <= datetime.now(UTC)


def _image_json(image: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "system",
        "status": "available",
        "labels": {},
        "deprecation": None,
        "rapid_deploy": True,
        **image,
    }


def _find(catalog: list[dict[str, Any]], ref: Any) -> dict[str, Any] | None:
    """Look up a catalog entry by name or id (the API accepts both)."""
    return next((item for item in catalog if ref in (item["id"], item["name"], str(item["id"]))), None)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.fakes.hetzner_api --port P --token-file F``: the fake on a fixed port
    until interrupted (``CATACLOUD_DEV_CLOUD=fake make dev`` runs it, testkit/dev_cloud.py)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m tests.fakes.hetzner_api")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file", required=True, help="the one API token it accepts")
    args = parser.parse_args(argv)
    fake = FakeHetzner(token=Path(args.token_file).read_text().strip(), port=args.port).start()
    print(f"fake Hetzner Cloud API at {fake.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
