"""The agent wheel the control plane serves to its machines, pinned by checksum in their user data.

``CATACLOUD_AGENT_WHEEL`` names a built ``catacloud-agent`` wheel (``pip wheel --no-deps -w dist
./agent``), or a folder holding one (the newest version wins; the image builds it into
``/app/dist``). The Agent API serves it at ``/api/agent/v1/dist/<its file name>``, and a cloud
machine's user data installs ``<CATACLOUD_AGENT_URL>/api/agent/v1/dist/<file>#sha256=<digest>``:
pip refuses a download whose digest differs, so a machine runs exactly the agent of the control
plane that bought it, version and bytes, with no package index. There is no other source:
without a wheel to serve, no cloud machine is made (its creation fails ``permanent:``, saying
so), never one that installs a name from a public index.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from apps.core.errors import ErrorCode, error_payload
from apps.machines.install_host import render_install_script

WHEEL = re.compile(r"^catacloud_agent-(?P<version>[0-9][0-9A-Za-z.+!-]*)-py3-none-any\.whl$")
PATH = "dist/"


def _version_key(path: Path) -> tuple[int | str, ...]:
    m = WHEEL.match(path.name)
    version = m["version"] if m else ""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+-]", version))


def agent_wheel() -> Path | None:
    """The wheel to serve, or None when ``CATACLOUD_AGENT_WHEEL`` is unset or holds none."""
    configured = str(getattr(settings, "CATACLOUD_AGENT_WHEEL", "") or "")
    if not configured:
        return None
    path = Path(configured)
    if path.is_dir():
        wheels = sorted((p for p in path.iterdir() if WHEEL.match(p.name)), key=_version_key)
        return wheels[-1] if wheels else None
    return path if path.is_file() and WHEEL.match(path.name) else None


@lru_cache(maxsize=8)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256(str(path), stat.st_mtime_ns, stat.st_size)


def agent_package(agent_url: str) -> str:
    """What a new cloud machine's user data pip-installs: the served wheel pinned by its sha256;
    empty when none is served (``Bootstrap.user_data`` then refuses to make a cloud machine)."""
    wheel = agent_wheel()
    if wheel is None:
        return ""
    return f"{agent_url.rstrip('/')}/api/agent/v1/{PATH}{wheel.name}#sha256={wheel_sha256(wheel)}"


def agent_wheel_view(request: HttpRequest, filename: str) -> HttpResponse:
    """``GET /api/agent/v1/dist/<file>``: the agent wheel, to anyone (it is the public code the
    machines run; they ask before they have credentials). Any other name is a 404."""
    wheel = agent_wheel()
    if wheel is None or filename != wheel.name:
        return JsonResponse({"code": "not_found", "detail": "no such agent wheel here"}, status=404)
    response = HttpResponse(wheel.read_bytes(), content_type="application/octet-stream")  # tens of kB
    response["Content-Disposition"] = f'attachment; filename="{wheel.name}"'
    response["X-Checksum-Sha256"] = wheel_sha256(wheel)
    return response


def install_host_view(request: HttpRequest) -> HttpResponse:
    """``GET /api/agent/v1/dist/install-host.sh``: the script that makes a machine an enrolled
    host (apps.machines.install_host), with this control plane's agent URL and its served wheel
    pinned by sha256; to anyone, like the wheel (it holds no secret). 503
    ``install_script_unavailable`` when there is no wheel to pin, or no agent URL a script may hold."""
    agent_url = str(settings.CATACLOUD_AGENT_URL)
    package = agent_package(agent_url)
    try:
        if not package:
            raise ValueError("this control plane serves no agent wheel (set CATACLOUD_AGENT_WHEEL)")
        script = render_install_script(agent_url=agent_url, wheel_url=package)
    except ValueError as exc:
        body = error_payload(ErrorCode.INSTALL_SCRIPT_UNAVAILABLE, f"no host install script here: {exc}")
        return JsonResponse(body, status=503)
    response = HttpResponse(script, content_type="text/x-shellscript; charset=utf-8")
    response["Cache-Control"] = "no-cache"  # it names the wheel of the day
    return response
