"""``CATACLOUD_DEV_CLOUD=fake make dev``'s fake cloud, prepared: ``python -m testkit.dev_cloud
HOME WEB_PORT FAKE_PORT`` writes the fake Hetzner Cloud API's token (once, 0600, in HOME), builds
the agent wheel the control plane serves to cloud machines (as the image does: without one no
cloud machine is made), and prints JSON: where the fake listens, the command that runs it
(tests/fakes/hetzner_api.py), and the settings that send organizations' own Hetzner accounts
there (``CATACLOUD_ORG_PROVIDER_SETTINGS``, docs/walkthroughs/own-cloud.md) and serve the wheel
(``CATACLOUD_AGENT_WHEEL``). ``make dev`` runs this by name."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from testkit.forge_common import secret_file


def prepare(home: Path, web_port: int, port: int) -> dict[str, object]:
    url = f"http://127.0.0.1:{port}/v1"
    token = home / "hetzner-fake-token"
    secret_file(token, secrets.token_urlsafe(24))
    command = [
        sys.executable,
        "-m",
        "tests.fakes.hetzner_api",
        "--port",
        str(port),
        "--token-file",
        str(token),
    ]
    settings = {"hetzner": {"api_endpoint": url, "poll_interval": 0.2}}
    env = {
        "CATACLOUD_ORG_PROVIDER_SETTINGS": json.dumps(settings),
        "CATACLOUD_AGENT_WHEEL": str(agent_wheel(home)),
    }
    return {"url": url, "command": command, "env": env}


def agent_wheel(home: Path) -> Path:
    """The agent wheel of this checkout (``pip wheel --no-deps ./agent``, as the image builds
    it), in a folder of its own under HOME, built afresh at every start (a few seconds)."""
    folder = home / "agent-wheel"
    shutil.rmtree(folder, ignore_errors=True)
    agent = Path(__file__).resolve().parents[1] / "agent"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(folder), str(agent)],
        check=True,
        stdout=sys.stderr,  # stdout carries the JSON answer
        timeout=300,
    )
    return folder


if __name__ == "__main__":
    home, web_port, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(prepare(home, web_port, port)))
