"""The organization's registry credentials for a containers job's engine, never in the job's
hands; and the machine's image store as the engine's first source of layers.

A job's own engine (catacloud/agent/containers.py) runs as the job's uid: any credential file it
could read, the job could read. So the engine is given none. For every registry the organization
holds credentials for, the job's ``registries.conf`` names a **mirror** on the job's own loopback
(``127.0.0.1:PORT/<grant>/<key>``, forwarded by the job's pasta to this agent's listener, like an
allowed loopback port): this agent answers there, adds the credentials and fetches from the
registry. What the job can do with it is what ``docker pull`` does and no more:

- **Pull only.** ``GET`` and ``HEAD`` of the distribution API's read paths (``/v2/`` ping,
  ``<name>/manifests/<ref>``, ``<name>/blobs/<digest>``, ``<name>/tags/list``: the OCI
  distribution spec's "pull" and "content discovery" endpoints); anything else is ``405``, and a
  token asked of a registry's token service names ``repository:<name>:pull`` alone (the Docker
  token authentication spec's scope), so a job cannot push with the organization's account.
- **Its own grant.** Each job gets a random 160-bit grant, in the mirror's path, revoked when the
  job ends; an unknown grant is ``404`` (the distribution spec's ``NAME_UNKNOWN``), like a name
  that does not exist.
- **The job's network rules.** The agent connects from the machine's network, so it reaches the
  registry only at an address the job's own namespace would reach (the internet, or what its
  machine type's ``network.allow`` names: :meth:`~catacloud.agent.netns.Policy.reaches`), checked
  for the address it then connects to (no second lookup a name could answer differently). The
  same holds for a token service a registry names.
- **Its share.** At most :data:`MAX_PER_GRANT` requests of one job in flight (more wait
  :data:`QUEUE_SECONDS`, then ``429``), :data:`MAX_CONNECTIONS` in all (more are closed at
  once), each cut unless its request head arrives whole within :data:`HEAD_SECONDS`, and
  :data:`TOKEN_BURST` token requests of one job, then :data:`TOKEN_RATE` a second (``429``): one
  job cannot hold the mirror from another, nor make it hammer a registry's token service with
  the organization's login, name after name.
- **No redirect followed.** A registry that sends a blob elsewhere (a CDN's signed URL) answers
  with a redirect, passed on to the engine as it came: the engine follows it from the job's own
  network, under the job's rules, carrying no credential (the redirect's URL is all it gets).

**Seeded from the machine's image store.** The registries of the images the machine holds are
mirrored too (anonymously, where the organization has no credentials for them), and a blob the
store holds for the repository asked (a config or a layer its held image of that repository
names: :meth:`~catacloud.agent.images.ImageStore.blob_for`) is served from the store: an image
the machine holds is not downloaded a second time. Manifests are always the registry's (a tag
may have moved; the engine checks every blob against the manifest's digest).

Where the machine has no job network (pasta missing), the job reaches no loopback port of the
agent's, so no mirror is written: pulls go to the registries directly, without credentials.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from catacloud.agent.netns import Policy
from catacloud.agent.reference import DEFAULT_REGISTRY

log = logging.getLogger("catacloud.agent")

# Docker Hub's references say docker.io; its registry API answers at this host (containers/image
# docker/docker_client.go: dockerHostname -> dockerRegistry "registry-1.docker.io").
DOCKER_HUB_API = "registry-1.docker.io"
TIMEOUT_SECONDS = 30.0
CHUNK = 256 * 1024
# The OCI distribution spec's grammar: a tag, a digest, a repository name's path components.
_TAG = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[A-Za-z0-9=_-]{1,256}"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_PULL_PATH = re.compile(
    rf"^/v2/(?P<grant>[0-9a-f]{{40}})/(?P<key>r[0-9]{{1,3}})/(?P<name>{_COMPONENT}(?:/{_COMPONENT})*)"
    rf"/(?:(?P<kind>manifests|blobs)/(?P<ref>{_TAG}|{_DIGEST})|(?P<tags>tags/list))$"
)
MAX_PER_GRANT = 16  # requests one job's engine may have in flight at once (more wait, then 429)
QUEUE_SECONDS = 10.0  # how long a request beyond them waits for one to end
MAX_CONNECTIONS = 128  # connections of every job together (more are closed at once)
HEAD_SECONDS = 10.0  # to send a request's line and headers, whole (a trickle is cut)
MAX_TOKENS = 256  # authorizations one grant keeps (one per repository it pulled)
TOKEN_BURST, TOKEN_RATE = 20, 1.0  # token requests one grant may cause: a burst, then per second
CONNECT_SECONDS = 5.0  # per address of a registry, before the next is tried
# What passes from the registry's answer to the engine (never a cookie or an auth header).
_RELAYED = (
    "Content-Type",
    "Content-Length",
    "Content-Range",
    "Accept-Ranges",
    "Docker-Content-Digest",
    "Docker-Distribution-API-Version",
    "ETag",
    "Link",
    "Location",
)
_FORWARDED = ("Accept", "Range", "If-None-Match")  # what passes from the engine to the registry
_RANGE = re.compile(r"bytes=[0-9]{1,19}-[0-9]{0,19}")


@dataclass(frozen=True)
class Login:
    """One registry's credentials (``registry`` as references name it: ``host`` or ``host:port``)."""

    registry: str
    username: str = ""  # "": none (the machine's image store seeds it; pulls go anonymously)
    password: str = ""
    plain_http: bool = False  # a loopback or operator-named registry: HTTP, as the agent pulls

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DEFAULT_REGISTRY else self.registry

    @property
    def anonymous(self) -> bool:
        return not self.username

    @property
    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


@dataclass
class Grant:
    """What one job may pull with: its logins (by key), the rules its network holds to."""

    logins: dict[str, Login]
    policy: Policy
    # The machine's image store: the path of a blob it holds for ``registry/name``, or None.
    seed: Callable[[str, str], str | None] | None = None
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)  # (key, name) -> Authorization
    lock: threading.Lock = field(default_factory=threading.Lock)
    token_budget: list[float] = field(default_factory=lambda: [float(TOKEN_BURST), 0.0])  # left, at
    in_flight: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_PER_GRANT)
    )

    def may_ask_token(self, now: float) -> bool:
        """One more token request of this grant's, within :data:`TOKEN_BURST` and
        :data:`TOKEN_RATE` (a job cannot make the agent hammer a registry's token service with
        the organization's login, name after name)."""
        with self.lock:
            left, at = self.token_budget
            left = min(float(TOKEN_BURST), left + (now - at) * TOKEN_RATE if at else left)
            if left < 1:
                self.token_budget[:] = [left, now]
                return False
            self.token_budget[:] = [left - 1, now]
            return True

    def keep_token(self, key: str, name: str, authorization: str) -> None:
        with self.lock:
            if len(self.tokens) >= MAX_TOKENS:
                self.tokens.pop(next(iter(self.tokens)))
            self.tokens[(key, name)] = authorization


class Refused(Exception):
    """The registry (or its token service) is where the job's network may not go, or unusable."""


class Busy(Exception):
    """The grant asked the registry's token service too often: 429."""


class RegistryProxy:
    """The agent's listener for every containers job's mirrors (one port; a grant per job)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()
        self._host = host
        self._server: _Server | None = None

    @property
    def port(self) -> int:
        return self._start().server_address[1]

    def _start(self) -> _Server:
        with self._lock:
            if self._server is None:
                server = _Server((self._host, 0), self)
                threading.Thread(target=server.serve_forever, name="registry-proxy", daemon=True).start()
                self._server = server
            return self._server

    def grant(
        self, logins: Iterable[Login], policy: Policy, seed: Callable[[str, str], str | None] | None = None
    ) -> tuple[str, list[tuple[Login, str]]]:
        """A new grant for one job: its id and, per login, the mirror location its
        ``registries.conf`` names (:meth:`revoke` ends it)."""
        port = self.port
        token = secrets.token_hex(20)
        keyed = {f"r{i}": login for i, login in enumerate(logins)}
        with self._lock:
            self._grants[token] = Grant(keyed, policy, seed)
        return token, [(login, f"127.0.0.1:{port}/{token}/{key}") for key, login in keyed.items()]

    def revoke(self, token: str) -> None:
        with self._lock:
            self._grants.pop(token, None)

    def find(self, token: str) -> Grant | None:
        with self._lock:
            return self._grants.get(token)

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            self._grants.clear()
        if server is not None:
            server.shutdown()
            server.server_close()
            server.closing.set()


class _Server(ThreadingHTTPServer):
    """One thread per connection, :data:`MAX_CONNECTIONS` at most; a connection that has not sent
    its whole request head within :data:`HEAD_SECONDS` is cut (a per-read timeout alone lets a
    client that trickles a byte at a time hold its thread for ever)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], proxy: RegistryProxy) -> None:
        super().__init__(address, _Handler)
        self.proxy = proxy
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.heads: dict[Any, float] = {}  # connections still sending their head: their deadline
        self.heads_lock = threading.Lock()
        self.closing = threading.Event()
        threading.Thread(target=self._cut_slow_heads, name="registry-proxy-heads", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        with self.heads_lock:
            self.heads[request] = time.monotonic() + HEAD_SECONDS
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def head_read(self, request: Any) -> None:
        with self.heads_lock:
            self.heads.pop(request, None)

    def _done(self, request: Any) -> None:
        self.head_read(request)
        self.slots.release()

    def _cut_slow_heads(self) -> None:
        while not self.closing.wait(1.0):
            now = time.monotonic()
            with self.heads_lock:
                late = [request for request, deadline in self.heads.items() if deadline < now]
                for request in late:
                    del self.heads[request]
            for request in late:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server_version = "catacloud-registry-mirror"
    protocol_version = "HTTP/1.0"  # one answer per connection: the body ends when it closes
    timeout = TIMEOUT_SECONDS  # a client that reads nothing for this long is let go
    server: _Server
    answered = False  # a status line went out: an error can no longer be told

    def parse_request(self) -> bool:
        done = super().parse_request()  # the request line and every header are read by now
        self.server.head_read(self.request)
        return done

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("registry mirror: %s", _GRANT_IN_PATH.sub("/v2/…/", format % args))

    def do_GET(self) -> None:
        self._pull(body=True)

    def do_HEAD(self) -> None:
        self._pull(body=False)

    def _refuse_write(self) -> None:
        self._error(405, "UNSUPPORTED", "this mirror only pulls: push to the registry itself")

    do_POST = do_PUT = do_PATCH = do_DELETE = _refuse_write

    def _pull(self, *, body: bool) -> None:
        path, _, query = self.path.partition("?")
        if path in ("/v2", "/v2/"):  # the API version check every client makes first
            self._answer(200, b"{}", body=body)
            return
        match = _PULL_PATH.match(path)
        grant = self.server.proxy.find(match["grant"]) if match else None
        login = grant.logins.get(match["key"]) if grant is not None and match else None
        if grant is None or login is None or match is None:
            self._error(404, "NAME_UNKNOWN", "repository name not known to registry")
            return
        name = match["name"]
        upstream = f"/v2/{name}/" + (f"{match['kind']}/{match['ref']}" if match["kind"] else "tags/list")
        paging = {k: v[0] for k, v in urllib.parse.parse_qs(query).items() if k in ("n", "last")}
        if match["tags"] and paging:  # the spec's pagination, and nothing else
            upstream += "?" + urllib.parse.urlencode(paging)
        headers = _forwarded(self.headers)
        if not grant.in_flight.acquire(timeout=QUEUE_SECONDS):
            self._error(429, "TOOMANYREQUESTS", f"more than {MAX_PER_GRANT} pulls at once")
            return
        try:
            if match["kind"] == "blobs" and grant.seed is not None:
                held = grant.seed(f"{login.registry}/{name}", match["ref"])
                if held is not None and self._send_file(held, match["ref"], body=body):
                    return
            answer = _fetch(grant, match["key"], login, name, "GET" if body else "HEAD", upstream, headers)
            with contextlib.closing(answer):
                self._relay(answer, login, upstream, body=body, tags=(match["grant"], match["key"], name))
        except Busy:
            self._error(429, "TOOMANYREQUESTS", "too many token requests: slow down")
        except Refused as exc:
            self._error(502, "UNAVAILABLE", f"{login.registry}: {exc}")
        except (OSError, http.client.HTTPException, ValueError) as exc:  # ValueError: a bad header
            self._error(502, "UNAVAILABLE", f"{login.registry} did not answer: {type(exc).__name__}")
        finally:
            grant.in_flight.release()

    def _relay(
        self,
        answer: http.client.HTTPResponse,
        login: Login,
        upstream: str,
        *,
        body: bool,
        tags: tuple[str, str, str],
    ) -> None:
        relayed = []
        for name in _RELAYED:
            value = answer.getheader(name)
            if value is None or "\r" in value or "\n" in value:
                continue
            if name == "Location":  # a relative one is the registry's: the engine must not come back here
                value = urllib.parse.urljoin(f"{_scheme(login)}://{login.api_host}{upstream}", value)
            if name == "Link":  # the tag list's next page (the spec's pagination), through this mirror
                link = _next_page(value, *tags)
                if link is None:
                    continue
                value = link
            relayed.append((name, value))
        self.send_response(answer.status)
        self.answered = True
        for name, value in relayed:
            self.send_header(name, value)
        self.end_headers()
        if not body:
            return
        # The engine went away, or the registry's body broke off: the connection's end tells the
        # engine its body is short (it has the length, and the digest), and it retries.
        with contextlib.suppress(OSError, http.client.HTTPException):
            while chunk := answer.read(CHUNK):
                self.wfile.write(chunk)

    def _send_file(self, path: str, digest: str, *, body: bool) -> bool:
        """A blob from the machine's image store (no second download of what the machine holds),
        whole or the byte range asked (206, as a registry answers a resumed download); False
        when it went in the meantime (evicted): the registry is asked instead."""
        try:
            held = open(path, "rb")  # noqa: SIM115 (closed below; an eviction now leaves it readable)
        except OSError:
            return False
        with held:
            size = os.fstat(held.fileno()).st_size
            asked = _byte_range(_forwarded(self.headers).get("Range"), size)
            first, last = asked or (0, size - 1)
            if asked is not None and first > last:  # nothing of it can be given: RFC 9110 15.5.17
                self.send_response(416)
                self.answered = True
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
            partial = asked is not None
            self.send_response(206 if partial else 200)
            self.answered = True
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(last - first + 1))
            if partial:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Docker-Content-Digest", digest)
            self.end_headers()
            if body:
                held.seek(first)
                left = last - first + 1
                with contextlib.suppress(OSError):
                    while left > 0 and (chunk := held.read(min(CHUNK, left))):
                        self.wfile.write(chunk)
                        left -= len(chunk)
        return True

    def _answer(self, status: int, data: bytes, *, body: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        if self.answered:  # its body broke off: the connection's end is all the engine can be told
            self.close_connection = True
            return
        # The distribution spec's error body: {"errors": [{"code", "message", "detail"}]}.
        self._answer(status, json.dumps({"errors": [{"code": code, "message": message}]}).encode())


_GRANT_IN_PATH = re.compile(r"/v2/[0-9a-f]{40}/")


def _forwarded(headers: Any) -> dict[str, str]:
    """What of the engine's request goes on to the registry: every ``Accept`` it sent (one line per
    media type, as containers/image sends them: the registry picks the manifest's format by
    them), a plain byte ``Range``, ``If-None-Match``; no value holding a line break."""
    accept = ", ".join(v.strip() for v in headers.get_all("Accept") or [])
    chosen = {"Accept": accept, "Range": headers.get("Range"), "If-None-Match": headers.get("If-None-Match")}
    out = {}
    for name, value in chosen.items():
        if not value or "\r" in value or "\n" in value:
            continue
        if name == "Range" and not _RANGE.fullmatch(value):
            continue
        out[name] = value
    return out


def _byte_range(asked: str | None, size: int) -> tuple[int, int] | None:
    """The first and last byte a ``Range: bytes=N-[M]`` asks of ``size`` bytes: None for the
    whole (none asked, or one that is not a range: RFC 9110 14.2 says to ignore it), first >
    last when none of it exists."""
    if not asked:
        return None
    start, _, end = asked.removeprefix("bytes=").partition("-")
    first, last = int(start), (int(end) if end else size - 1)
    if last < first and end:
        return None
    return first, min(last, size - 1)


def _next_page(link: str, grant: str, key: str, name: str) -> str | None:
    """A tag list's ``Link: </v2/NAME/tags/list?…>; rel="next"``, pointed at this mirror's path for
    the same repository; None for any other link (not passed on)."""
    found = re.fullmatch(
        r"<(/v2/" + re.escape(name) + r'/tags/list\?[^>\s]*)>(\s*;\s*rel="next")', link.strip()
    )
    if found is None:
        return None
    return f"<{found[1].replace('/v2/', f'/v2/{grant}/{key}/', 1)}>{found[2]}"


def _scheme(login: Login) -> str:
    return "http" if login.plain_http else "https"


def _fetch(
    grant: Grant, key: str, login: Login, name: str, method: str, path: str, headers: dict[str, str]
) -> http.client.HTTPResponse:
    """The registry's answer to one pull request, with the login's authorization: the one this
    grant last earned for the repository, or (on a 401) a new one from the challenge."""
    with grant.lock:
        known = grant.tokens.get((key, name))
    answer = _request(grant.policy, login, method, path, headers, known)
    if answer.status != 401:
        return answer
    challenge = answer.getheader("WWW-Authenticate", "")
    answer.close()
    if not grant.may_ask_token(time.monotonic()):
        raise Busy()
    authorization = _authorize(grant.policy, login, name, challenge)
    if authorization is None:
        return _request(grant.policy, login, method, path, headers, None)  # its 401, as it is
    grant.keep_token(key, name, authorization)
    return _request(grant.policy, login, method, path, headers, authorization)


def _request(
    policy: Policy,
    login: Login,
    method: str,
    path: str,
    headers: dict[str, str],
    authorization: str | None,
    *,
    url: urllib.parse.SplitResult | None = None,
) -> http.client.HTTPResponse:
    where = url or urllib.parse.urlsplit(f"{_scheme(login)}://{login.api_host}")
    connection = _connect(policy, where)
    default = 443 if where.scheme == "https" else 80
    host = where.hostname if (where.port or default) == default else f"{where.hostname}:{where.port}"
    sent = {**headers, "Host": str(host), "User-Agent": "catacloud-agent"}
    if authorization:
        sent["Authorization"] = authorization
    target = path if url is None else (url.path or "/") + (f"?{url.query}" if url.query else "")
    connection.request(method, target, headers=sent)
    return connection.getresponse()


def _connect(policy: Policy, url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
    """A connection to ``url``'s host at an address the job's network reaches (checked here, for
    the address used), TLS verified against the host's name unless the URL is plain HTTP."""
    if url.scheme not in ("http", "https") or not url.hostname:
        raise Refused(f"{url.geturl()!r} is not an http(s) URL")
    tls = url.scheme == "https"
    port = url.port or (443 if tls else 80)
    candidates = socket.getaddrinfo(url.hostname, port, type=socket.SOCK_STREAM)
    reachable = [c for c in candidates if policy.reaches(_address(c[4][0]), port)]
    if not reachable:
        address = candidates[0][4][0] if candidates else url.hostname
        raise Refused(f"{url.hostname} ({address}) is outside what this job's network may reach")
    sock = _first_connected(reachable)
    try:
        sock.settimeout(TIMEOUT_SECONDS)
        if tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=url.hostname)
    except BaseException:
        sock.close()
        raise
    connection = http.client.HTTPConnection(url.hostname, port, timeout=TIMEOUT_SECONDS)
    connection.sock = sock  # request() uses it as it is: no second name lookup
    return connection


def _first_connected(candidates: list[Any]) -> socket.socket:
    """A socket connected to the first of ``candidates`` (getaddrinfo's, all checked) that
    answers within :data:`CONNECT_SECONDS` (an IPv6 address first on a host with no IPv6 route
    must not be the end of it); the last error if none does."""
    failure: OSError = OSError("no address")
    for family, kind, proto, _, sockaddr in candidates:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(CONNECT_SECONDS)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
    raise failure


def _address(text: str | int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(str(text).split("%")[0])  # an IPv6 scope id is not an address's


def _authorize(policy: Policy, login: Login, name: str, challenge: str) -> str | None:
    """The Authorization a 401's challenge asks for: Basic with the login, or a Bearer token the
    registry's token service issues for ``repository:<name>:pull`` (the Docker token
    authentication spec: GET realm?service=…&scope=…, Basic auth, JSON ``token`` or
    ``access_token``). None when neither works (the registry's 401 then reaches the engine)."""
    scheme, _, rest = challenge.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    if scheme.lower() == "basic":
        return None if login.anonymous else login.basic
    if scheme.lower() != "bearer" or not params.get("realm"):
        return None
    realm = urllib.parse.urlsplit(params["realm"])
    if realm.scheme != "https" and not login.plain_http and not login.anonymous:
        return None  # the login is not sent in the clear to a service a TLS registry names
    query = {"scope": f"repository:{name}:pull"}
    if params.get("service"):
        query["service"] = params["service"]
    separator = "&" if realm.query else ""
    url = realm._replace(query=realm.query + separator + urllib.parse.urlencode(query))
    try:
        basic = None if login.anonymous else login.basic  # anonymous: Docker Hub's public pulls
        answer = _request(policy, login, "GET", "", {"Accept": "application/json"}, basic, url=url)
        with contextlib.closing(answer):
            if answer.status != 200:
                return None
            issued = json.loads(answer.read(1 << 20) or b"{}")
    except (Refused, OSError, http.client.HTTPException, ValueError) as exc:
        log.warning("registry mirror: no token from %s: %s", realm.hostname, exc)
        return None
    token = issued.get("token") or issued.get("access_token") if isinstance(issued, dict) else None
    return f"Bearer {token}" if isinstance(token, str) and token else None


def registries_conf_entries(
    mirrors: Sequence[tuple[Login, str]], plain_http: Iterable[str]
) -> list[tuple[str, bool, str | None]]:
    """(location, insecure, mirror) for the job's registries.conf: one entry per location (Podman
    refuses a location named twice), a credentialed registry's with its mirror."""
    entries: dict[str, tuple[bool, str | None]] = {h: (True, None) for h in plain_http}
    for login, location in mirrors:
        already_plain = entries.get(login.registry, (False, None))[0]
        entries[login.registry] = (login.plain_http or already_plain, location)
    return [(location, insecure, mirror) for location, (insecure, mirror) in entries.items()]
