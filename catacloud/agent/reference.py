"""Container image references: ``registry/repository:tag`` or ``registry/repository@sha256:<hex>``.

The grammar is the one registries and ``docker pull`` accept (the CNCF distribution project's
``reference`` package), normalised the same way: a first path component that is not a host
(no ``.`` or ``:``, not ``localhost``) means Docker Hub (``docker.io``, one component:
``docker.io/library/NAME``), and a reference with neither tag nor digest means ``:latest``.

Both sides use it: the control plane refuses a malformed reference at submission (400 naming the
field) and stores the normalised form; the agent pulls what it names. Standard library only.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from dataclasses import dataclass, replace

DEFAULT_REGISTRY = "docker.io"
DEFAULT_TAG = "latest"
MAX_NAME = 255  # the repository's name with its registry, as the distribution project caps it

_HOST_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = re.compile(rf"^{_HOST_COMPONENT}(?:\.{_HOST_COMPONENT})*(?::[0-9]{{1,5}})?$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")


@dataclass(frozen=True)
class ImageRef:
    """A normalised reference; ``str()`` gives its canonical text."""

    registry: str  # host[:port]
    repository: str  # path components joined by "/"
    tag: str | None = None
    digest: str | None = None  # sha256:<64 hex>

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    @property
    def name(self) -> str:
        """registry/repository, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def pinned(self, digest: str) -> ImageRef:
        """The same repository at exactly ``digest`` (no tag: a tag may move)."""
        return replace(self, tag=None, digest=digest)

    @property
    def moving(self) -> bool:
        """``:latest`` without a digest: asked for again at every use (as Kubernetes' default
        pull policy does); any other tag is taken from the machine's store when it has it."""
        return self.digest is None and self.tag == DEFAULT_TAG

    @property
    def host(self) -> str:
        """The registry's host without its port."""
        return self.registry.rsplit(":", 1)[0] if ":" in self.registry else self.registry

    def plain_http(self, insecure: Collection[str] = ()) -> bool:
        """Pulled over plain HTTP: a registry on loopback, or one the machine's operator named
        (``--insecure-registry``, lowercase ``host`` or ``host:port`` in ``insecure``)."""
        return self.loopback or self.registry.lower() in insecure or self.host.lower() in insecure

    @property
    def loopback(self) -> bool:
        """A registry on this machine's loopback (reached over plain HTTP, as Docker allows)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse(text: object) -> ImageRef:
    """``text`` as an :class:`ImageRef`, normalised; ``ValueError`` saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("expected an image reference such as registry.example.com/team/tool:1.2")
    raw = text.strip()
    if any(c.isspace() for c in raw):
        raise ValueError(f"{raw!r}: an image reference has no spaces")
    rest, digest = raw, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise ValueError(f"{raw!r}: the digest must be sha256: and 64 lowercase hex digits")
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG.match(tag):
            raise ValueError(
                f"{raw!r}: the tag {tag!r} must be at most 128 letters, digits, '_', '.' or '-' "
                "(not starting with '.' or '-')"
            )
    parts = rest.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        registry, path = parts[0], parts[1:]
        if not _HOST.match(registry):
            raise ValueError(f"{raw!r}: {registry!r} is not a registry host[:port]")
        port = registry.rsplit(":", 1)[1] if ":" in registry else None
        if port is not None and not 0 < int(port) < 65536:
            raise ValueError(f"{raw!r}: the port of {registry!r} is out of range")
    else:
        registry, path = DEFAULT_REGISTRY, parts
        if len(path) == 1:
            path = ["library", *path]
    for component in path:
        if not _PATH_COMPONENT.match(component):
            raise ValueError(
                f"{raw!r}: {component!r} is not a repository name component (lowercase letters, "
                "digits and single separators '.', '_', '__' or '-')"
            )
    repository = "/".join(path)
    if len(f"{registry}/{repository}") > MAX_NAME:
        raise ValueError(f"{raw!r}: the repository's name is longer than {MAX_NAME} characters")
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return ImageRef(registry=registry, repository=repository, tag=tag, digest=digest)


def registry_host(text: object) -> str:
    """A registry credential's scope: ``host`` or ``host:port`` (lowercase), or ``ValueError``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("expected a registry host such as registry.example.com or 127.0.0.1:5000")
    host = text.strip().lower()
    for prefix in ("https://", "http://"):
        host = host.removeprefix(prefix)
    host = host.rstrip("/")
    if host in ("index.docker.io", "registry-1.docker.io"):
        host = DEFAULT_REGISTRY
    if "/" in host or not _HOST.match(host):
        raise ValueError(f"{text!r} is not a registry host[:port] (no path, no scheme)")
    return host
