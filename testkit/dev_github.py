"""``CATACLOUD_DEV_GITHUB=fake make dev``'s fake GitHub, prepared: ``python -m testkit.dev_github
HOME WEB_PORT FAKE_PORT`` writes the fake App's key and webhook secret (once, 0600, in HOME),
the catalog that connects the demo org to it (the stand-in runner, testkit/github_runner,
shown in the demo's local machines at /opt/actions-runner; the runner class is the reader's to
create, docs/walkthroughs/github-actions.md, as with a real GitHub), and prints JSON: where the
fake listens, the catalog to apply, the command that runs it. ``make dev`` runs this by name."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

from testkit.forge_common import demo_machines, secret_file
from testkit.github_fake import app_keypair
from testkit.github_kit import RUNNER_MOUNT


def prepare(home: Path, web_port: int, port: int) -> dict[str, object]:
    url = f"http://127.0.0.1:{port}"
    key = home / "github-fake-app.pem"
    if not key.exists():  # a new key pair only when there is none
        secret_file(key, app_keypair()[0])
    secret = secret_file(home / "github-fake-webhook-secret", secrets.token_urlsafe(24))
    command = [
        sys.executable, "-m", "testkit.github_fake", "--port", str(port), "--app-id", "1",
        "--public-key-file", str(key), "--webhook-secret-file", str(secret),
        "--webhook-url", f"http://127.0.0.1:{web_port}/api/integrations/github/webhook",
        "--installation", "1", "--account", "demo-org", "--repository", "demo-org/app",
    ]  # fmt: skip
    # The demo's local machines show the stand-in runner at /opt/actions-runner; their jobs
    # reach the fake GitHub.
    catalog = home / "github-dev.yaml"
    catalog.write_text(
        demo_machines([RUNNER_MOUNT], [f"127.0.0.1:{port}"]) + "organizations:\n"
        "  - slug: demo\n"
        "    github:\n"
        "      app_id: 1\n"
        f"      api_url: {url}\n"
        f"      private_key: {{file: {key}}}\n"
        f"      webhook_secret: {{file: {secret}}}\n"
        "      installations: [{id: 1, account: demo-org}]\n"
    )
    return {"url": url, "catalog": str(catalog), "command": command}


if __name__ == "__main__":
    home, web_port, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(prepare(home, web_port, port)))
