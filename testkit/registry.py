"""A real container registry on loopback for the tests and benchmarks, and images they build.

:class:`Registry` runs Debian's ``docker-registry`` (the CNCF distribution server) on a free
loopback port with its data in a folder of the run, optionally behind htpasswd users (bcrypt, as
the server requires), as the test kit runs PostgreSQL and Redis. :func:`build_image` makes an
image from Debian's ``busybox-static`` with ``umoci`` (a root with ``/bin/sh`` and friends, an
``/etc/os-release`` only the image has, files of the caller's choosing, its config) and
:func:`push` sends it with ``skopeo``: the same tools the agent pulls with.

:class:`FaultyProxy` sits between a client and the registry and misbehaves on purpose: answers
503, cuts a blob's transfer half way, or stalls it, a given number of times.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from testkit.processes import free_port

BUSYBOX = "/bin/busybox"
APPLETS = (
    "sh",
    "cat",
    "echo",
    "ls",
    "env",
    "id",
    "pwd",
    "head",
    "wc",
    "sleep",
    "touch",
    "mkdir",
    "printf",
    "true",  # `docker run --rm busybox true` as the issue writes it (benchmarks/containers.py)
)
INSTALL = "apt install docker-registry skopeo umoci busybox-static"


def missing_tools() -> list[str]:
    return [
        name
        for name, path in (
            ("docker-registry", shutil.which("docker-registry")),
            ("skopeo", shutil.which("skopeo")),
            ("umoci", shutil.which("umoci")),
            ("busybox-static", BUSYBOX if os.path.exists(BUSYBOX) else None),
        )
        if path is None
    ]


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the registry did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


class Registry:
    """``docker-registry serve`` on ``127.0.0.1:<port>``; ``users`` turns htpasswd on."""

    def __init__(
        self,
        folder: Path,
        *,
        users: Mapping[str, str] | None = None,
        port: int | None = None,
        token: bool = False,
        anonymous_pulls: bool = False,
    ) -> None:
        self.folder = folder
        self.users = dict(users or {})
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # token: the registry asks for Bearer tokens from a token service (Docker Hub's, GHCR's
        # way), this kit's TokenService, instead of Basic auth (htpasswd).
        self.tokens = TokenService(self.folder, self.users, anonymous_pulls) if token else None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def start(self) -> Registry:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = [
            "version: 0.1",
            "log:",
            "  level: error",
            "  accesslog:",
            "    disabled: true",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.data}",
            "  delete:",
            "    enabled: true",
            "http:",
            f"  addr: 127.0.0.1:{self.port}",
        ]
        if self.tokens is not None:
            self.tokens.start()
            config += [
                "auth:",
                "  token:",
                f"    realm: {self.tokens.url}/token",
                f"    service: {TokenService.SERVICE}",
                f"    issuer: {TokenService.ISSUER}",
                f"    rootcertbundle: {self.tokens.certificate}",
            ]
        elif self.users:
            import bcrypt

            lines = [
                f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}"
                for user, password in self.users.items()
            ]
            (self.folder / "htpasswd").write_text("\n".join(lines) + "\n")
            config += [
                "auth:",
                "  htpasswd:",
                "    realm: catacloud-test",
                f"    path: {self.folder / 'htpasswd'}",
            ]
        (self.folder / "config.yml").write_text("\n".join(config) + "\n")
        log = (self.folder / "registry.log").open("wb")
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(self.folder / "config.yml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.folder,
            start_new_session=True,
        )
        log.close()
        try:
            _wait_port(self.port)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.tokens is not None:
            self.tokens.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    def blob_paths(self, digest: str) -> Path:
        hexdigest = digest.split(":", 1)[1]
        return self.data / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run(*args: str, cwd: Path | None = None) -> str:
    result = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}\n{result.stderr}")
    return result.stdout


@dataclass
class BuiltImage:
    layout: Path
    tag: str
    files: dict[str, bytes] = field(default_factory=dict)


def build_image(
    work: Path,
    tag: str,
    *,
    files: Mapping[str, bytes] = {},
    os_release: str = 'ID=catacloud-test\nNAME="Catacloud test image"\n',
    env: Mapping[str, str] = {},
    cmd: tuple[str, ...] = ("sh",),
    entrypoint: tuple[str, ...] = (),
    workdir: str = "",
    with_shell: bool = True,
    base: BuiltImage | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> BuiltImage:
    """An image in the OCI layout ``work/oci``: busybox as ``/bin/sh`` (unless ``with_shell`` is
    false), ``/etc/os-release``, ``files`` ({path: bytes}); on top of ``base``'s layers when given
    (a layer two images share). ``prepare`` gets the root before it is packed, to give files what
    ``files`` cannot (an owner, a mode, extended attributes, a device node): ``umoci repack``
    records them in the layer as they are."""
    layout = work / "oci"
    if not (layout / "index.json").exists():
        _run("umoci", "init", "--layout", str(layout))
    bundle = work / f"bundle-{tag}"
    shutil.rmtree(bundle, ignore_errors=True)
    if base is None:
        _run("umoci", "new", "--image", f"{layout}:{tag}")
        _run("umoci", "unpack", "--rootless", "--image", f"{layout}:{tag}", str(bundle))
        rootfs = bundle / "rootfs"
        (rootfs / "bin").mkdir(parents=True)
        (rootfs / "etc").mkdir()
        if with_shell:
            shutil.copy(BUSYBOX, rootfs / "bin" / "busybox")
            for applet in APPLETS:
                (rootfs / "bin" / applet).symlink_to("busybox")
        (rootfs / "etc" / "os-release").write_text(os_release)
    else:
        _run("umoci", "tag", "--image", f"{base.layout}:{base.tag}", tag)
        _run("umoci", "unpack", "--rootless", "--image", f"{layout}:{tag}", str(bundle))
        rootfs = bundle / "rootfs"
    for path, data in files.items():
        target = rootfs / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    if prepare is not None:
        prepare(rootfs)
    _run("umoci", "repack", "--image", f"{layout}:{tag}", str(bundle))
    config = ["umoci", "config", "--image", f"{layout}:{tag}", "--clear=config.env"]
    for name, value in {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **env,
    }.items():
        config += ["--config.env", f"{name}={value}"]
    config += ["--clear=config.cmd", "--clear=config.entrypoint"]
    for arg in cmd:
        config += ["--config.cmd", arg]
    for arg in entrypoint:
        config += ["--config.entrypoint", arg]
    if workdir:
        config += ["--config.workingdir", workdir]
    _run(*config)
    shutil.rmtree(bundle, ignore_errors=True)
    return BuiltImage(layout=layout, tag=tag, files=dict(files))


def push(image: BuiltImage, destination: str, *, credentials: tuple[str, str] | None = None) -> str:
    """Push ``image`` to ``destination`` (``host:port/repo:tag``); its manifest digest."""
    digest_file = image.layout.parent / f"{image.tag}.digest"
    args = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--digestfile", str(digest_file)]
    if credentials is not None:
        args += ["--dest-creds", f"{credentials[0]}:{credentials[1]}"]
    _run(*args, f"oci:{image.layout}:{image.tag}", f"docker://{destination}")
    return digest_file.read_text().strip()


class TokenService:
    """A registry's token service, as the distribution project's token authentication spec says
    (docs/spec/auth/token.md, "Requesting a Token"): ``GET /token?service=…&scope=…`` with the
    user's Basic credentials answers ``{"token": JWT}``, a JWT (RS256, the signing certificate in
    its ``x5c`` header, which the registry checks against its ``rootcertbundle``) whose
    ``access`` claim grants each asked scope's actions (``repository:NAME:pull,push``) to a known
    user, nothing to anyone else (401); with ``anonymous_pulls``, a request without credentials
    gets a token for the ``pull`` it asks and nothing more (Docker Hub's public repositories).
    Records every scope asked for (:attr:`scopes`)."""

    SERVICE = "catacloud-test-registry"
    ISSUER = "catacloud-test-token-service"

    def __init__(self, folder: Path, users: Mapping[str, str], anonymous_pulls: bool = False) -> None:
        self.folder, self.users, self.anonymous_pulls = folder, dict(users), anonymous_pulls
        self.port = free_port()
        self.scopes: list[str] = []
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def certificate(self) -> Path:
        return self.folder / "token-signer.pem"

    def start(self) -> None:
        import base64
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.ISSUER)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        self.certificate.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        chain = [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                import time as clock
                import urllib.parse

                import jwt

                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                user = _basic_user(self.headers.get("Authorization", ""), service.users)
                scopes = query.get("scope", [])
                service.scopes += scopes
                header = self.headers.get("Authorization")
                anonymous = header is None and service.anonymous_pulls
                if (user is None and not anonymous) or query.get("service") != [TokenService.SERVICE]:
                    self.send_response(401)
                    self.end_headers()
                    return
                access = []
                for scope in scopes:  # repository:NAME:ACTIONS (NAME may hold no ":" here)
                    kind, repo, actions = scope.split(":", 2)
                    granted = [a for a in actions.split(",") if user is not None or a == "pull"]
                    access.append({"type": kind, "name": repo, "actions": granted})
                issued = int(clock.time())
                claims = {
                    "iss": TokenService.ISSUER,
                    "sub": user or "",
                    "aud": TokenService.SERVICE,
                    "iat": issued,
                    "nbf": issued - 60,
                    "exp": issued + 300,
                    "jti": os.urandom(8).hex(),
                    "access": access,
                }
                token = jwt.encode(claims, key, algorithm="RS256", headers={"x5c": chain})
                body = json.dumps({"token": token, "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _basic_user(header: str, users: Mapping[str, str]) -> str | None:
    import base64
    import hmac

    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(value).decode().partition(":")
    except ValueError:
        return None
    known = users.get(user)
    return user if known is not None and hmac.compare_digest(known, password) else None


def manifest(image: BuiltImage) -> dict:
    index = json.loads((image.layout / "index.json").read_text())
    for entry in index["manifests"]:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == image.tag:
            hexdigest = entry["digest"].split(":", 1)[1]
            return json.loads((image.layout / "blobs" / "sha256" / hexdigest).read_text())
    raise KeyError(image.tag)


class FaultyProxy:
    """An HTTP proxy in front of ``upstream`` (``host:port``) that misbehaves on purpose, on blob
    downloads (``GET …/blobs/sha256:…``): ``fail`` of them answer 503, ``cut`` of them stop
    after half their body, ``stall`` of them hang (until :meth:`stop`). Counts what it served."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.fail = 0
        self.cut = 0
        self.stall = 0
        self.requests: list[str] = []
        self.blob_bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                proxy._forward(self)

            def do_GET(self) -> None:
                proxy._forward(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FaultyProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    def blob_gets(self) -> int:
        return sum(1 for r in self.requests if r.startswith("GET ") and "/blobs/" in r)

    def manifest_requests(self) -> int:
        return sum(1 for r in self.requests if "/manifests/" in r)

    def _take(self, name: str) -> bool:
        with self._lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
                return True
            return False

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        line = f"{handler.command} {handler.path}"
        with self._lock:
            self.requests.append(line)
        blob = handler.command == "GET" and "/blobs/sha256:" in handler.path
        if blob and self._take("fail"):
            handler.send_response(503)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        upstream = http.client.HTTPConnection(self.upstream, timeout=60)
        upstream.putrequest(handler.command, handler.path, skip_accept_encoding=True)
        for key, value in handler.headers.items():  # every Accept: a registry answers by them
            if key.lower() not in ("connection", "host"):
                upstream.putheader(key, value)
        upstream.endheaders()
        response = upstream.getresponse()
        body = response.read() if handler.command == "GET" else b""
        handler.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                handler.send_header(key, value)
        length = int(response.getheader("Content-Length") or len(body))
        handler.send_header("Content-Length", str(length))
        handler.end_headers()
        upstream.close()
        if handler.command != "GET":
            return
        if blob and response.status == 200 and self._take("stall"):
            handler.wfile.write(body[: len(body) // 2])
            handler.wfile.flush()
            self._stop.wait(600)
            handler.close_connection = True
            return
        if blob and response.status == 200 and self._take("cut"):
            handler.wfile.write(body[: len(body) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
            return
        handler.wfile.write(body)
        if blob and response.status == 200:
            with self._lock:
                self.blob_bytes += len(body)


@contextlib.contextmanager
def running(folder: Path, **kwargs: object) -> Iterator[Registry]:
    registry = Registry(folder, **kwargs)  # type: ignore[arg-type]
    with registry:
        yield registry
