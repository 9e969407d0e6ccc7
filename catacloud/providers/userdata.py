"""cloud-init user data that installs the agent on a fresh cloud machine and starts it.

What it installs is the ``catacloud-agent`` distribution: the agent and its ``catacloud`` command
with ``requests`` and ``psutil``, not the server and its dependencies (Django, Celery, boto3,
hcloud, psycopg). It comes from one place only, the wheel the control plane serves, pinned by its
sha256 (``<agent url>/api/agent/v1/dist/<wheel>#sha256=<digest>``): pip refuses other bytes, and
no name is ever looked up on a public index, where anyone could publish it.

The only secret in it is the single-use bootstrap token, written to a root-only file (0600);
the agent exchanges it for its real credentials when it enrolls. The agent runs as root, and runs
each job in a bubblewrap sandbox as a uid of its own (``--job-uids``, default 2000000000+65536),
never root: no account is created for jobs.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import yaml

from catacloud.agent.containers import HOST_PACKAGES

VENV = "/opt/catacloud"
TOKEN_FILE = "/etc/catacloud/bootstrap-token"
# The agent's enrollment (root-only): a restarted agent resumes instead of enrolling again.
# In a folder of its own (0700): the work folder's parent must stay passable for the job user.
STATE_FILE = "/var/lib/catacloud/agent/agent.json"
WORK_DIR = "/var/lib/catacloud/work"
UNIT_NAME = "catacloud-agent.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}"
# The instance metadata service, at the same link-local address on EC2 and Azure; the kinds of
# interruption notices the agent reads from it (catacloud/agent/imds.py).
IMDS_URL = "http://169.254.169.254"
SPOT_NOTICES = ("", "ec2", "azure")

# No whitespace, quotes, backslashes or control characters anywhere: nothing can break out of
# the YAML scalar, the systemd ExecStart line or pip's argument.
_URL_CHARS = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&()*+,;=%]+$")
_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{16,512}$")
# The agent wheel, pinned: https://host/.../catacloud_agent-<version>-py3-none-any.whl#sha256=<hex>.
_PINNED_WHEEL = re.compile(
    r"^https?://[A-Za-z0-9\-._~:/@%]+/catacloud_agent-[0-9][0-9A-Za-z.+!-]*-py3-none-any\.whl#sha256=[0-9a-f]{64}$"
)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


# passt (pasta) and nftables: each job's network reaches the internet and nothing else
# (catacloud/agent/netns.py); without them jobs get no network at all. skopeo and umoci pull and
# unpack jobs' images (catacloud/agent/images.py).
PACKAGES = ("python3-venv", "passt", "nftables", "skopeo", "umoci")
# A job's container engine and its networks, on machine types that allow containers.
CONTAINER_PACKAGES = HOST_PACKAGES  # catacloud/agent/containers.py


def render_user_data(
    *,
    agent_url: str,
    bootstrap_token: str,
    package: str = "",
    disk_gb: int | None = None,
    spot_notices: str = "",
    containers: bool = False,
) -> str:
    """Render a ``#cloud-config`` document; ``ValueError`` for unsafe or malformed inputs.

    ``package`` is the pinned agent wheel's URL; anything else is refused. Empty, the document
    installs no agent (what ``Bootstrap.user_data`` never renders: it refuses to make a cloud
    machine without a served wheel).

    ``spot_notices`` (``ec2`` or ``azure``, for a spot machine) makes the agent watch the machine's
    metadata service at 169.254.169.254 for interruption notices of that kind (EC2's
    spot/instance-action, Azure's Scheduled Events); empty, it watches none. ``containers``
    installs :data:`CONTAINER_PACKAGES`."""
    parts = urlsplit(agent_url) if _URL_CHARS.match(agent_url) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("agent_url must be an http(s) URL without spaces, quotes or control characters")
    if not _TOKEN.match(bootstrap_token):
        raise ValueError("bootstrap_token must be 16-512 URL-safe characters")
    if package and not _PINNED_WHEEL.match(package):
        raise ValueError(
            "package must be the agent wheel's http(s) URL pinned by its sha256 "
            "(.../catacloud_agent-<version>-py3-none-any.whl#sha256=<64 hex digits>)"
        )
    if disk_gb is not None and (not isinstance(disk_gb, int) or isinstance(disk_gb, bool) or disk_gb < 1):
        raise ValueError("disk_gb must be a whole number of at least 1")
    if spot_notices not in SPOT_NOTICES:
        raise ValueError(f"spot_notices must be one of {', '.join(map(repr, SPOT_NOTICES))}")

    # systemd expands "%" specifiers and "$" variables in ExecStart: double them.
    url_for_systemd = agent_url.replace("%", "%%").replace("$", "$$")
    unit = "\n".join(
        [
            "[Unit]",
            "Description=Catacloud agent",
            "Wants=network-online.target",
            "After=network-online.target",
            "",
            "[Service]",
            f"ExecStart={VENV}/bin/catacloud agent --url {url_for_systemd}"
            f" --bootstrap-token-file {TOKEN_FILE} --state-file {STATE_FILE} --work-dir {WORK_DIR}"
            # The jobs' disk: the agent (root) mounts a file system of this size on the work root.
            + (f" --disk-gb {disk_gb}" if disk_gb else "")
            # A spot machine's agent watches its metadata service for the interruption notice.
            + (f" --imds-url {IMDS_URL} --imds-kind {spot_notices}" if spot_notices else ""),
            "Restart=always",
            "RestartSec=5",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )
    document: dict[str, Any] = {
        "package_update": True,
        "packages": [*PACKAGES, *(CONTAINER_PACKAGES if containers else ())],
        "write_files": [
            {
                "path": TOKEN_FILE,
                "owner": "root:root",
                "permissions": "0600",
                "content": bootstrap_token,
            },
            {"path": UNIT_PATH, "owner": "root:root", "permissions": "0644", "content": unit},
        ],
        # List form: each command runs without a shell, so arguments are never re-parsed.
        "runcmd": [
            ["python3", "-m", "venv", VENV],
            *([[f"{VENV}/bin/pip", "install", "--upgrade", package]] if package else []),
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "--now", UNIT_NAME],
        ],
    }
    return "#cloud-config\n" + yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
