"""Cloud machines install the agent from the control plane itself, pinned by version and
checksum: the Agent API serves the wheel ``CATACLOUD_AGENT_WHEEL`` names, and user data asks pip
for ``<agent url>/api/agent/v1/dist/<wheel>#sha256=<digest>``, which pip refuses when the
bytes differ."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from django.test import Client

from apps.machines import lifecycle
from testkit.processes import TESTS
from tests.conftest import World

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent wheel as the image builds it (``pip wheel --no-deps ./agent``)."""
    folder = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(folder),
            str(ROOT / "agent"),
        ],
        check=True,
        timeout=300,
    )
    assert len(list(folder.glob("catacloud_agent-*.whl"))) == 1
    return folder


def _pip_target(user_data: str) -> str:
    document = yaml.safe_load(user_data.split("\n", 1)[1])
    (install,) = [cmd for cmd in document["runcmd"] if cmd[1:3] == ["install", "--upgrade"]]
    return install[-1]


@pytest.mark.django_db
def test_user_data_installs_the_served_wheel_pinned_by_its_sha256(
    world: World, wheels: Path, settings: object
) -> None:
    settings.CATACLOUD_AGENT_WHEEL = str(wheels)  # type: ignore[attr-defined]
    settings.CATACLOUD_AGENT_URL = "https://cc.example.com"  # type: ignore[attr-defined]
    (wheel,) = wheels.glob("*.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    instance = lifecycle.instance_request(org=world.org, machine_type=world.machine_type)

    target = _pip_target(lifecycle.machine_spec(instance).bootstrap.user_data())

    assert target == f"https://cc.example.com/api/agent/v1/dist/{wheel.name}#sha256={digest}"
    served = Client().get(f"/api/agent/v1/dist/{wheel.name}")
    assert served.status_code == 200 and hashlib.sha256(served.content).hexdigest() == digest
    assert served["X-Checksum-Sha256"] == digest
    assert Client().get("/api/agent/v1/dist/catacloud_agent-0.0.1-py3-none-any.whl").status_code == 404
    assert Client().get("/api/agent/v1/dist/..%2Fsettings.py").status_code == 404


def test_a_package_name_instead_of_the_served_wheel_stops_the_control_plane_at_start(tmp_path: Path) -> None:
    """CATACLOUD_AGENT_PACKAGE (a name pip looked up on the machines' index) is gone: a setting
    left over refuses to start, saying where the agent comes from now."""
    env = {
        "PATH": os.environ["PATH"],
        "CATACLOUD_HOME": str(tmp_path),
        "DJANGO_DEBUG": "true",
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "CATACLOUD_AGENT_PACKAGE": "catacloud-agent==0.1.0",
    }
    started = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode != 0
    assert "CATACLOUD_AGENT_PACKAGE is gone" in started.stderr and "CATACLOUD_AGENT_WHEEL" in started.stderr


@pytest.fixture
def served(wheels: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with TESTS.gunicorn(tmp_path, workers=1, threads=4, CATACLOUD_AGENT_WHEEL=str(wheels)) as (url, _):
        yield url, next(wheels.glob("*.whl"))


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_pip_installs_the_wheel_the_control_plane_serves_and_refuses_other_bytes(
    served: tuple[str, Path], wheels: Path, tmp_path: Path
) -> None:
    url, wheel = served
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pinned = f"{url}/api/agent/v1/dist/{wheel.name}#sha256={digest}"

    def download(target: str) -> subprocess.CompletedProcess[str]:
        dest = tmp_path / "download"
        shutil.rmtree(dest, ignore_errors=True)
        return subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d", str(dest), target],
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = download(pinned)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "download" / wheel.name).read_bytes() == wheel.read_bytes()
    # the bytes a machine would get from a tampered server (or an old pin) are refused
    refused = download(pinned.replace(digest, "0" * 64))
    assert refused.returncode != 0 and "HASH" in refused.stderr.upper(), refused.stderr
    assert requests.get(f"{url}/api/agent/v1/dist/other.whl", timeout=10).status_code == 404
