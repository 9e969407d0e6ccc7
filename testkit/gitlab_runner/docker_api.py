"""Docker's Engine API on a Unix socket, standard library only: the calls the stand-in runner's
docker executor makes, as gitlab-runner's Docker client makes them (pull, create, start, read the
output, wait, kill, remove). The socket is ``$DOCKER_HOST`` (``unix://PATH``): gitlab-runner's
``[runners.docker] host`` defaults to it (helpers/docker ``New``: ``client.FromEnv``). On a
machine type with ``containers: true`` it is the job's own Podman, which answers Docker's API.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import urllib.parse
from collections.abc import Iterator
from typing import Any

API = "/v1.41"  # what Podman 4's compatible API serves (and Docker 20.10)


class DockerError(Exception):
    """The engine refused a call: its status and message (``{"message": ...}``)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("docker", timeout=timeout)  # the Host header Docker's clients send
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Docker:
    def __init__(self, host: str) -> None:
        if not host.startswith("unix://"):
            raise DockerError(f"DOCKER_HOST {host!r}: this stand-in speaks to a unix:// socket only")
        self.path = host.removeprefix("unix://")

    def _open(
        self, method: str, path: str, body: Any = None, timeout: float | None = 600
    ) -> http.client.HTTPResponse:
        connection = _UnixConnection(self.path, timeout)
        data = json.dumps(body).encode() if body is not None else None
        connection.request(method, API + path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status >= 400:
            raw = response.read()
            try:
                message = json.loads(raw).get("message", raw.decode(errors="replace"))
            except ValueError:
                message = raw.decode(errors="replace")
            raise DockerError(f"{method} {path}: HTTP {response.status}: {message}")
        return response

    def call(self, method: str, path: str, body: Any = None, timeout: float = 600) -> Any:
        raw = self._open(method, path, body, timeout).read()
        return json.loads(raw) if raw.strip() else None

    def pull(self, image: str) -> None:
        """``POST /images/create``: its answer is a stream of JSON progress lines, an error among
        them when the pull failed (the status stays 200)."""
        name, tag = split_tag(image)
        query = urllib.parse.urlencode({"fromImage": name, **({"tag": tag} if tag else {})})
        for line in self._open("POST", f"/images/create?{query}").read().splitlines():
            if line.strip() and "error" in (event := json.loads(line)):
                raise DockerError(f"pulling {image}: {event['error']}")

    def output(self, container: str) -> Iterator[bytes]:
        """``GET /containers/{id}/logs?follow=1``: the container's output until it ends, each piece
        in its frame (8 bytes: the stream, three zero bytes, the length, big-endian), as
        ``stdcopy.StdCopy`` reads them for a container without a terminal."""
        path = f"/containers/{container}/logs?follow=1&stdout=1&stderr=1"
        response = self._open("GET", path, timeout=None)
        while len(header := response.read(8)) == 8:
            _stream, size = struct.unpack(">BxxxL", header)
            yield response.read(size)


def split_tag(image: str) -> tuple[str, str]:
    """``registry:5000/team/app:1`` -> (``registry:5000/team/app``, ``1``); no tag: ``latest``;
    a digest (``app@sha256:…``) is the name whole, its tag empty (fromImage takes it so)."""
    if "@" in image:
        return image, ""
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return image, "latest"
    return name, tag
