"""What the GitHub and GitLab set-ups (testkit/github_kit.py, testkit/gitlab_kit.py, and
``make dev``'s testkit/dev_github.py, testkit/dev_gitlab.py) share: a stand-in runner's folder
shown in local machines, a fake forge on this host's loopback let through a machine type's
allow list, runner classes saved for a fake, and the files and catalog of ``make dev``.

Models and services are imported inside the functions: importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from apps.core.actors import Actor

DEMO_CATALOG = Path(__file__).resolve().parents[1] / "catacloud" / "data" / "demo.yaml"


def expose_mount(account: Any, mount: dict[str, str]) -> None:
    """Show ``mount`` (a stand-in runner's folder) in every machine of a local ``account``
    started from now on (like an image: a machine already running never sees it, so call this
    before a pool of the account warms)."""
    if account.kind != "local":
        return
    mounts = [m for m in account.config.get("mounts") or [] if m.get("target") != mount["target"]]
    account.config["mounts"] = [*mounts, mount]
    account.save(update_fields=["config", "updated_at"])


def allow_loopback(machine_type: Any, url: str) -> None:
    """Let jobs of ``machine_type`` reach the service at ``url`` on this host's loopback (the fake
    forge the stand-in runner talks to), through the machine type's ``network.allow`` as an
    operator's cache would be: a job's network reaches nothing else of the host."""
    from urllib.parse import urlsplit

    from apps.machines.services import machine_type_update

    entry = f"127.0.0.1:{urlsplit(url).port}"
    allow = list((machine_type.network or {}).get("allow") or [])
    if entry not in allow:
        machine_type_update(
            machine_type=machine_type, actor=Actor.TESTKIT, network={"allow": [*allow, entry]}
        )
        machine_type.refresh_from_db()


def classes_saved(
    org: Any,
    fake_url: str,
    classes: Iterable[Mapping[str, Any]],
    *,
    save: Callable[..., tuple[Any, bool]],
    expose_runner: Callable[[Any], None],
    defaults: Mapping[str, Any],
) -> list[Any]:
    """Save ``classes`` (each ``defaults`` overridden by its spec) through the forge's ``save``,
    each shown the stand-in runner in its machine type's local machines (``expose_runner``),
    its jobs let through to the fake at ``fake_url``. Returns them."""
    saved = []
    for spec in classes:
        rc, _ = save(org=org, actor=Actor.TESTKIT, **{**defaults, **spec})
        saved.append(rc)
        expose_runner(rc.machine_type.provider_account)
        allow_loopback(rc.machine_type, fake_url)
    return saved


def secret_file(path: Path, value: str) -> Path:
    """``path`` holding ``value`` (0600), unless it exists already: a secret kept across runs."""
    if not path.exists():
        path.write_text(value)
        path.chmod(0o600)
    return path


def demo_machines(mounts: list[dict[str, str]], allow: list[str]) -> str:
    """The catalog text of the demo's local account, its machines showing ``mounts`` (the
    stand-in runners' folders), and of its ``local-small`` machine type, whose jobs reach
    ``allow`` (the fakes on this host's loopback, as an operator's cache would be reached;
    nothing else of the host)."""
    demo = yaml.safe_load(DEMO_CATALOG.read_text())
    local = next(a for a in demo["provider_accounts"] if a["name"] == "local")
    local["config"] = {**(local.get("config") or {}), "mounts": mounts}
    small = next(t for t in demo["machine_types"] if t["name"] == "local-small")
    small["network"] = {"allow": allow}
    text: str = yaml.safe_dump({"provider_accounts": [local], "machine_types": [small]}, sort_keys=False)
    return text
