"""The operator console in a real browser: headless Chromium (Debian's) driven by Playwright.

Nothing is downloaded at run time: Playwright drives /usr/bin/chromium. Without Chromium the
test says so and is skipped; `.ci/run` installs it so CI runs it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from apps.machines.models import MachineInstance
from apps.pools.models import InstancePool
from tests.conftest import World

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)"),
]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the test's ORM calls are
    # still plain synchronous code, so tell Django not to refuse them.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield page
        # ORM calls made while Playwright's loop is set get their own connection (asgiref
        # keys connections by context); close them here, or the test database stays in use.
        from django.db import connections

        connections.close_all()
        browser.close()


def test_operator_logs_in_and_sees_orgs_and_pools(
    tworld: World,
    live_server,
    browser_page,
    tmp_path: Path,
) -> None:
    get_user_model().objects.create_superuser("ops", password="a-long-ops-password")
    pool = InstancePool.objects.create(
        org=tworld.org,
        name="ci-runners",
        machine_type=tworld.machine_type,
        target_size=2,
        max_size=4,
        status="ready",
    )
    members = [
        MachineInstance.objects.create(
            org=tworld.org,
            machine_type=tworld.machine_type,
            provider_account=tworld.account,
            pool=pool,
            status=status,
            provider_id=f"local-{i}",
        )
        for i, status in enumerate(["ready", "claimed"])
    ]
    page = browser_page
    page.goto(f"{live_server.url}/admin/")
    assert "Log in" in page.title()
    page.fill("#id_username", "ops")
    page.fill("#id_password", "a-long-ops-password")
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")
    assert "Catacloud operator console" in page.inner_text("#site-name")

    page.goto(f"{live_server.url}/admin/orgs/organization/{tworld.org.pk}/change/")
    text = page.inner_text("#content").lower()
    assert "machine type grants and quotas" in text
    assert "admin" in text and "viewer" in text  # members inline with their roles
    page.screenshot(path=str(tmp_path / "organization.png"), full_page=True)

    page.goto(f"{live_server.url}/admin/pools/instancepool/{pool.pk}/change/")
    text = page.inner_text("#content")
    assert "ci-runners" in page.input_value("#id_name")
    for member in members:
        assert str(member.pk) in text
    assert "claimed" in text and "ready" in text
    page.screenshot(path=str(tmp_path / "pool.png"), full_page=True)
