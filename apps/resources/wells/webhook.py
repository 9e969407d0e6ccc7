"""``webhook``: your own create and destroy URLs, so any system plugs in without code.

Config: ``create_url``, ``destroy_url``, optional ``timeout`` (s) and ``headers_env`` (name of
an environment variable holding a JSON object of extra headers, e.g. an Authorization header;
never stored in the database). Create: ``POST create_url {"resource_id", "job_id", "org"}`` →
2xx ``{"id": ..., "metadata": {...}, "secret": {...}}``. Destroy: ``POST destroy_url
{"resource_id", "id", "job_id"}`` → 2xx (404 counts as done). 5xx, 429 and network errors are
retried with backoff until they succeed; other 4xx are permanent.

Where it may go: redirects are never followed (a 3xx is a permanent failure: a far side
could otherwise send the POST, headers and all, to an address of its choosing), and the
address actually connected to (after DNS, so a name that changes its answer gains nothing)
must be public unless ``CATACLOUD_WEBHOOK_ALLOW_NETWORKS`` lists its network. Connections
are direct: proxy variables (``HTTPS_PROXY``) are not used.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import Any

import requests
from django.conf import settings
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from apps.resources.wells import Created, Well, WellPermanent, WellTransient
from catacloud.agent.netns import refused_everywhere


class ForbiddenTarget(OSError):
    """The webhook connected to an address it may not reach."""


def refused_address(ip: str) -> bool:
    """True for an address that is not public (private, loopback, link-local, shared, reserved,
    multicast, unspecified, or refused to jobs: an IPv4 address inside IPv6, NAT64 of a private
    one, 6to4, ...: catacloud/agent/netns.py) and not in ``CATACLOUD_WEBHOOK_ALLOW_NETWORKS``."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in ipaddress.ip_network(net) for net in settings.CATACLOUD_WEBHOOK_ALLOW_NETWORKS):
        return False
    return not addr.is_global or addr.is_multicast or refused_everywhere(str(addr))


def _refuse(ip: str) -> ForbiddenTarget:
    return ForbiddenTarget(
        f"{ip} is not a public address (CATACLOUD_WEBHOOK_ALLOW_NETWORKS may allow its network)"
    )


def _guarded_conn(conn: HTTPConnection, connect: Any) -> socket.socket:
    """Refuse before connecting when the name resolves to a refused address (a permanent
    failure, not a timeout retried for ever), and check the peer actually connected to."""
    host = str(conn._dns_host)  # urllib3: the name it resolves (brackets removed)
    try:
        infos = socket.getaddrinfo(host, conn.port, type=socket.SOCK_STREAM)
    except OSError:
        infos = []  # let the connection report the name error
    for *_, sockaddr in infos:
        if refused_address(str(sockaddr[0])):
            raise _refuse(str(sockaddr[0]))
    sock: socket.socket = connect()
    peer = str(sock.getpeername()[0])
    if refused_address(peer):  # the name answered differently the second time
        sock.close()
        raise _refuse(peer)
    return sock


class _HTTPConnection(HTTPConnection):
    def _new_conn(self) -> socket.socket:
        return _guarded_conn(self, super()._new_conn)


class _HTTPSConnection(HTTPSConnection):
    def _new_conn(self) -> socket.socket:
        return _guarded_conn(self, super()._new_conn)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class _GuardedAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment: the address checked is the target's
    session.mount("http://", _GuardedAdapter())
    session.mount("https://", _GuardedAdapter())
    return session


def _forbidden(exc: BaseException) -> ForbiddenTarget | None:
    """The ForbiddenTarget behind what requests raised (urllib3 wraps it), if any."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, ForbiddenTarget):
            return item
        stack += [item.__cause__, item.__context__, *[a for a in item.args if isinstance(a, BaseException)]]
        stack.append(getattr(item, "reason", None))
    return None


class WebhookWell(Well):
    kind = "webhook"

    def _post(self, url_key: str, body: dict[str, Any]) -> requests.Response:
        url = self.config.get(url_key)
        if not url:
            raise WellPermanent(f"webhook well needs {url_key}")
        headers = {"Content-Type": "application/json"}
        if self.config.get("headers_env"):
            headers.update(json.loads(os.environ.get(str(self.config["headers_env"]), "{}")))
        try:
            with _session() as session:
                response = session.post(
                    url,
                    json=body,
                    headers=headers,
                    timeout=float(self.config.get("timeout", 30)),
                    allow_redirects=False,
                )
        except requests.RequestException as exc:
            forbidden = _forbidden(exc)
            if forbidden is not None:
                raise WellPermanent(f"{url_key}: {forbidden}") from None
            raise WellTransient(f"{url_key}: {type(exc).__name__}") from None
        if response.is_redirect or 300 <= response.status_code < 400:
            raise WellPermanent(f"{url_key} answered {response.status_code}: redirects are not followed")
        if response.status_code >= 500 or response.status_code == 429:
            raise WellTransient(f"{url_key} answered {response.status_code}")
        return response

    def create(self, *, resource_id: str, job: Any) -> Created:
        response = self._post(
            "create_url", {"resource_id": resource_id, "job_id": str(job.pk), "org": job.org.slug}
        )
        if not response.ok:
            raise WellPermanent(f"create_url answered {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise WellPermanent("create_url did not answer JSON") from None
        return Created(
            external_id=str(body.get("id", resource_id)),
            metadata=dict(body.get("metadata") or {}),
            secret=dict(body.get("secret") or {}),
        )

    def destroy(self, *, resource_id: str, external_id: str, job_id: str | None) -> None:
        response = self._post(
            "destroy_url", {"resource_id": resource_id, "id": external_id, "job_id": job_id}
        )
        if not response.ok and response.status_code != 404:
            raise WellPermanent(f"destroy_url answered {response.status_code}")
