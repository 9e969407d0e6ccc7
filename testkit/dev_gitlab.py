"""``CATACLOUD_DEV_GITLAB=fake make dev``'s fake GitLab, prepared: ``python -m testkit.dev_gitlab
HOME WEB_PORT FAKE_PORT`` writes the fake's access token and webhook secret token (once, 0600,
in HOME), the catalog that connects the demo org to it (its project ``demo-group/app``, id 1; the
stand-in gitlab-runner, testkit/gitlab_runner, shown in the demo's local machines at
/opt/gitlab-runner; the runner class is the reader's to create, docs/walkthroughs/gitlab-ci.md,
as with a real GitLab), and prints JSON: where the fake listens, the catalog to apply, the
command that runs it. ``make dev`` runs this by name, after ``testkit.dev_github`` when both
fakes are asked for: this catalog keeps the fake GitHub's runner folder and port too."""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

from testkit import github_kit
from testkit.forge_common import demo_machines, secret_file
from testkit.gitlab_kit import RUNNER_MOUNT

PROJECT = (1, "demo-group/app")


def prepare(home: Path, web_port: int, port: int) -> dict[str, object]:
    url = f"http://127.0.0.1:{port}"
    token = secret_file(home / "gitlab-fake-token", f"glpat-{secrets.token_urlsafe(15)}")
    webhook_token = secret_file(home / "gitlab-fake-webhook-token", secrets.token_urlsafe(24))
    command = [
        sys.executable, "-m", "testkit.gitlab_fake", "--port", str(port),
        "--token-file", str(token), "--webhook-token-file", str(webhook_token),
        "--webhook-url", f"http://127.0.0.1:{web_port}/api/integrations/gitlab/webhook",
        "--project", f"{PROJECT[0]}:{PROJECT[1]}",
    ]  # fmt: skip
    with_github = os.environ.get("CATACLOUD_DEV_GITHUB") == "fake"
    # The demo's local machines show the stand-in runner at /opt/gitlab-runner (and the fake
    # GitHub's at /opt/actions-runner when that one runs too); their jobs reach the fake GitLab
    # (and the fake GitHub).
    mounts = [github_kit.RUNNER_MOUNT, RUNNER_MOUNT] if with_github else [RUNNER_MOUNT]
    allow = [f"127.0.0.1:{port}"]
    if with_github:
        allow.insert(0, f"127.0.0.1:{os.environ.get('GITHUB_FAKE_PORT', '8070')}")
    catalog = home / "gitlab-dev.yaml"
    catalog.write_text(
        demo_machines(mounts, allow) + "organizations:\n"
        "  - slug: demo\n"
        "    gitlab:\n"
        f"      url: {url}\n"
        f"      token: {{file: {token}}}\n"
        f"      webhook_token: {{file: {webhook_token}}}\n"
        f"      projects: [{{id: {PROJECT[0]}, path: {PROJECT[1]}}}]\n"
    )
    return {"url": url, "catalog": str(catalog), "command": command}


if __name__ == "__main__":
    home, web_port, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(prepare(home, web_port, port)))
