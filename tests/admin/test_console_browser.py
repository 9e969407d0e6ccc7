"""The operator console in a real browser: headless Chromium (Debian's) driven by Playwright.

Nothing is downloaded at run time: Playwright drives /usr/bin/chromium. Without Chromium the
test says so and is skipped; `.ci/run` installs it so CI runs it.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import shutil
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

import catacloud
from apps.billing.budgets import budget_set
from apps.events.services import event_record
from apps.jobs.models import Job, JobConfiguration, JobLogChunk
from apps.machines.models import MachineInstance
from testkit.builders import instance_row, pool_row
from tests.admin import test_console_pages as console_pages
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
    pool = pool_row(tworld.org, tworld.machine_type, "ci-runners", target_size=2, max_size=4, status="ready")
    members = [
        instance_row(tworld.org, tworld.machine_type, pool=pool, status=status, provider_id=f"local-{i}")
        for i, status in enumerate(["ready", "claimed"])
    ]
    page = browser_page
    log_in(page, live_server, at="/admin/")  # the console's front page asks for a login
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
        assert str(member.pk)[:8] in text  # short ids (the whole id in the tooltip)
    assert "claimed" in text and "ready" in text
    page.screenshot(path=str(tmp_path / "pool.png"), full_page=True)


# ---- the live dashboard and the job page ----------------------------------------------------------


# Screenshots go to tmp_path; CATACLOUD_SCREENSHOTS=docs writes README's pictures instead.
def shots_dir(tmp_path: Path) -> Path:
    return Path(os.environ.get("CATACLOUD_SCREENSHOTS") or tmp_path)


def assert_list_fits(page) -> None:
    """Every column visible without scrolling sideways, every row on one line."""
    shown = page.locator("#changelist .results").bounding_box()
    last = page.locator("#result_list thead th").last.bounding_box()
    assert last["x"] + last["width"] <= shown["x"] + shown["width"] + 1
    rows = page.locator("#result_list tbody tr")
    heights = {round(rows.nth(i).bounding_box()["height"]) for i in range(rows.count())}
    assert max(heights) < 40, heights  # no UUID wrapping over four lines


def log_in(page, live_server, *, at: str = "/admin/login/", lands_on: str = "#site-name") -> None:
    """An operator (a new superuser) logs in through the form that ``at`` shows, and the page
    that follows shows ``lands_on``."""
    get_user_model().objects.create_superuser("ops", password="a-long-ops-password")
    page.goto(f"{live_server.url}{at}")
    assert "Log in" in page.title()
    page.fill("#id_username", "ops")
    page.fill("#id_password", "a-long-ops-password")
    page.click("input[type=submit]")
    page.wait_for_selector(lands_on)


def demo_fleet(world: World) -> JobConfiguration:
    """Two pools mid-refill, a queue held by a quota and a budget, an hour of finished jobs,
    a machine lost and its job requeued."""
    rng = random.Random(7)
    now = timezone.now()
    budget_set(org=world.org, amount=Decimal("5"), period="day", actor="test")
    config = JobConfiguration.objects.create(
        org=world.org, name="nightly-build", machine_type=world.machine_type, command="make test"
    )
    for name, target, states in (
        ("ci-runners", 4, ["ready", "ready", "claimed", "claimed", "warming"]),
        ("gpu-burst", 2, ["claimed", "provisioning"]),
    ):
        pool = pool_row(
            world.org,
            world.machine_type,
            name,
            target_size=target,
            min_size=1,
            max_size=6,
            status="replenishing",
        )
        for status in states:
            instance_row(
                world.org,
                world.machine_type,
                pool=pool,
                status=status,
                provisioning_started_at=now - timedelta(minutes=rng.randint(5, 50)),
                last_heartbeat_at=now - timedelta(seconds=rng.randint(1, 20)),
            )
    jobs = []
    for i in range(240):
        finished = now - timedelta(seconds=rng.randint(30, 3500))
        run = timedelta(seconds=rng.randint(20, 300))
        wait = timedelta(seconds=rng.choice([1, 2, 3, 5, 8, 15, 40]) + (60 if i % 37 == 0 else 0))
        jobs.append(
            Job(
                org=world.org,
                config=config,
                machine_type=world.machine_type,
                command="make test",
                status="failed" if i % 11 == 0 else "succeeded",
                queued_at=finished - run - wait,
                started_at=finished - run,
                finished_at=finished,
            )
        )
    for reason, n, age in (("max_concurrent_jobs 10/10", 4, 95), ("budget 4.98/5.00 EUR today", 2, 300)):
        for _ in range(n):
            jobs.append(
                Job(
                    org=world.org,
                    config=config,
                    machine_type=world.machine_type,
                    command="make test",
                    pending_reason=reason,
                    queued_at=now - timedelta(seconds=age),
                )
            )
    queued = {job.pk: job.queued_at for job in jobs}
    Job.objects.bulk_create(jobs)  # created_at and queued_at are auto_now_add: set them after
    for pk, at in queued.items():
        Job.objects.filter(pk=pk).update(created_at=at, queued_at=at)
    lost = Job.objects.filter(status="failed").first()
    event_record(
        kind="job.requeued", org=world.org, job=lost, reason="machine_lost: agent silent for more than 90s"
    )
    event_record(
        kind="instance.lost",
        org=world.org,
        instance=MachineInstance.objects.first(),
        reason="agent silent for more than 90s",
    )
    return config


def test_the_dashboard_shows_the_fleet_and_refreshes_itself(
    tworld: World, live_server, browser_page, tmp_path: Path
) -> None:
    config = demo_fleet(tworld)
    page = browser_page
    log_in(page, live_server)
    page.click("text=Live dashboard")  # linked from every console page
    page.wait_for_selector("#cc-pools")
    text = page.inner_text("#content")
    assert "acme/ci-runners" in text and "5 live · target 4 · min 1 · max 6" in text
    assert "max_concurrent_jobs 10/10" in text and "budget 4.98/5.00 EUR today" in text
    assert "machines 7/20" in text
    assert "machine_lost: agent silent for more than 90s" in text
    assert page.locator("#cc-throughput svg rect").count() > 10  # an hour of bars
    page.screenshot(path=str(shots_dir(tmp_path) / "console-dashboard.png"), full_page=True)

    # New work shows up without a reload: htmx swaps the panel in every few seconds.
    page.evaluate("window.ccMarker = 'same page'")
    Job.objects.create(
        org=tworld.org,
        config=config,
        machine_type=tworld.machine_type,
        command="make test",
        pending_reason="gpu quota 8/8 in use",
    )
    page.wait_for_selector("text=gpu quota 8/8 in use", timeout=15_000)
    assert page.evaluate("window.ccMarker") == "same page"

    # The instance list: one line per machine, short ids, age, heartbeat, cost so far.
    page.goto(f"{live_server.url}/admin/machines/machineinstance/")
    assert page.locator("#result_list tbody tr").count() == 7
    page.screenshot(path=str(shots_dir(tmp_path) / "console-instances.png"), full_page=True)
    assert_list_fits(page)


def test_the_job_page_shows_log_artifacts_attempts_and_cancels(
    tworld: World, live_server, browser_page, tmp_path: Path, settings
) -> None:
    from apps.jobs.artifacts import artifact_store, get_store

    settings.CATACLOUD_STORAGE = "local"
    settings.CATACLOUD_STORAGE_DIR = str(tmp_path / "artifacts")
    get_store.cache_clear()
    job = console_pages.ran_job(tworld)
    for name, data in (("metrics.csv", b"epoch,loss\n1,0.9\n"), ("model/weights.bin", b"\0" * 4096)):
        artifact_store(
            job=job, kind="output", name=name, body=io.BytesIO(data), size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )  # fmt: skip
    page = browser_page
    log_in(page, live_server)
    page.goto(f"{live_server.url}/admin/jobs/job/")
    page.screenshot(path=str(shots_dir(tmp_path) / "console-jobs.png"), full_page=True)
    assert_list_fits(page)
    page.click(f"text={str(job.pk)[:8]}")  # short ids in the list
    page.wait_for_selector("#cc-log")
    text = page.inner_text("#content")
    assert "epoch 1 loss 0.9" in page.inner_text("#cc-log")
    assert "machine_lost: agent silent for 90s" in text
    assert "metrics.csv" in text and "model/weights.bin" in text
    assert "hunter2" not in page.content()
    assert page.locator("input[name=_save]").count() == 0 and page.locator(".deletelink").count() == 0
    page.screenshot(path=str(shots_dir(tmp_path) / "console-job.png"), full_page=True)

    # the log tail follows the running job without a reload
    JobLogChunk.objects.create(job=job, attempt=2, seq=2, stream="stdout", data="epoch 2 loss 0.4\n")
    page.wait_for_selector("text=epoch 2 loss 0.4", timeout=10_000)

    with page.expect_download() as download:
        page.click("text=metrics.csv")
    assert Path(download.value.path()).read_bytes() == b"epoch,loss\n1,0.9\n"

    page.click("#cc-cancel-job")
    page.wait_for_selector(".messagelist")
    assert "cancel requested" in page.inner_text(".messagelist")
    job.refresh_from_db()
    assert job.cancel_requested
    get_store.cache_clear()


# ---- a laptop screen ----------------------------------------------------------------------------------

LAPTOP = {"width": 1366, "height": 768}


def overflow(page) -> list[str]:
    """What scrolls sideways on this page: the page itself, or a list's scrolling box."""
    return page.evaluate(
        """() => [document.documentElement, ...document.querySelectorAll('#changelist .results, .cc-card')]
            .filter(el => el.scrollWidth > el.clientWidth + 1)
            .map(el => `${el.id || el.className || el.tagName}: ${el.scrollWidth} > ${el.clientWidth}`)"""
    )


def test_the_console_fits_a_laptop_screen(
    tworld: World, live_server, browser_page, tmp_path: Path, settings
) -> None:
    """1366×768: login lands on the live dashboard; the dashboard, a job, an instance and the job,
    instance and pool lists scroll only downwards; the pool bar's counts are never under a
    marker."""
    demo_fleet(tworld)
    console_pages.ci_world(tworld)  # the CI panel with its rows
    console_pages.paid_but_unused(tworld)  # a tail to show beside idle
    job = console_pages.ran_job(tworld)
    for machine in MachineInstance.objects.filter(status="claimed"):  # named cc-<its id>, as on Hetzner
        machine.provider_id, machine.claimed_by, machine.claimed_for = (
            f"cc-{machine.pk}",
            "runner-7",
            "build 1",
        )
        machine.save()
    instance = MachineInstance.objects.filter(status="claimed").first()
    page = browser_page
    page.set_viewport_size(LAPTOP)
    log_in(page, live_server, at="/admin/", lands_on="#cc-pools")
    assert page.url == f"{live_server.url}/admin/dashboard/"  # the live dashboard, not the stock index

    shots = shots_dir(tmp_path)
    pages = {
        "dashboard": "/admin/dashboard/",
        "job": f"/admin/jobs/job/{job.pk}/change/",
        "instance": f"/admin/machines/machineinstance/{instance.pk}/change/",
        "jobs": "/admin/jobs/job/",
        "instances": "/admin/machines/machineinstance/",
        "pools": "/admin/pools/instancepool/",
    }
    for name, path in pages.items():
        page.goto(f"{live_server.url}{path}")
        page.wait_for_load_state("load")
        lists = ("jobs", "instances", "pools")
        page.screenshot(
            path=str(shots / f"console-{name}.png"), full_page=name not in lists
        )  # a list: one screen
        assert overflow(page) == [], name
        if name in lists:
            assert_list_fits(page)
    rows = page.goto(f"{live_server.url}/admin/machines/machineinstance/") and page.inner_text("#result_list")
    assert f"cc-{str(instance.pk)[:8]}…" in rows and str(instance.pk) not in rows  # no UUID twice

    # The dashboard's pool bars: every count can be read, no marker drawn over it.
    page.goto(f"{live_server.url}/admin/dashboard/")
    covered = page.evaluate(
        """() => [...document.querySelectorAll('.cc-bar span')].filter(s => s.textContent.trim()).map(s => {
            const r = s.getBoundingClientRect();
            const top = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
            const ok = top === s || s.contains(top);
            return ok ? null : `${s.className} ${s.textContent}: under ${top && top.className}`;
        }).filter(Boolean)"""
    )
    assert covered == []


# ---- what an operator looks for ------------------------------------------------------------------


def test_the_console_shows_ci_the_unused_paid_tail_a_short_jobs_cost_and_live_machines_first(
    tworld: World, live_server, browser_page
) -> None:
    """A CI panel (each connection's availability, limits and webhook failures, each runner
    class's backlog), the tail beside idle, a 3-second job's cost, terminated machines out of
    the default list, the menu grouped as an operator looks for things, the version in the
    footer; on a laptop screen."""
    made = console_pages.ci_world(tworld)
    console_pages.paid_but_unused(tworld)
    job = console_pages.short_job(tworld)
    for _ in range(2):  # not started yet: they cost nothing so far
        instance_row(tworld.other_org, tworld.machine_type, status="ready")
    page = browser_page
    page.set_viewport_size(LAPTOP)
    log_in(page, live_server, at="/admin/", lands_on="#cc-ci")
    assert page.inner_text("#cc-version") == catacloud.__version__

    github = page.locator("#cc-ci-endpoints tr", has_text="GitHub · acme").inner_text()
    assert "installation 4242 (acme-gh)" in github and "waiting until" in github  # held by a limit
    assert "rate limit exhausted (resets in 180s)" in github and "812/4500" in github
    assert "2 limits, 3 pauses" in github
    assert "1 not acted on, 1 no class covers, 1 lost and sent again" in github
    assert "available" in page.locator("#cc-ci-endpoints tr", has_text="GitLab · acme").inner_text()
    backlog = page.locator("#cc-ci-classes tr", has_text="linux-2cpu").locator("td")
    cells = [backlog.nth(i).inner_text() for i in (2, 4, 5)]
    assert cells == ["3", "1 · 0", "1"]  # waiting, runners starting · online, running
    assert re.fullmatch(r"5m 0\ds", backlog.nth(3).inner_text())  # the oldest wait
    page.locator("#cc-ci-classes a", has_text="linux-2cpu").click()
    page.wait_for_selector("#runnerclass_form")
    assert str(made["github_class"].pk) in page.url

    page.goto(f"{live_server.url}/admin/dashboard/")
    page.wait_for_selector("#cc-costs")
    assert "tail (paid, unused)" in page.inner_text("#cc-costs thead").lower()
    acme = page.locator("#cc-costs tbody tr", has_text="acme")
    assert acme.locator("td.cc-idle").inner_text().startswith("10.8%")
    assert acme.locator("td.cc-tail").inner_text() == "85.0%"
    assert overflow(page) == []

    page.goto(f"{live_server.url}/admin/jobs/job/{job.pk}/change/")
    cost = page.inner_text(".field-cost")
    assert re.search(r"0\.00000[1-9] USD \(its share of", cost), cost

    page.goto(f"{live_server.url}/admin/machines/machineinstance/")
    assert page.locator("#result_list tbody tr").count() == 2  # the two live machines
    assert "terminated" not in page.inner_text("#result_list")
    page.locator("#changelist-filter a", has_text="all, terminated too").click()
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 5
    assert "terminated" in page.inner_text("#result_list")

    page.goto(f"{live_server.url}/admin/")
    groups = [c.strip() for c in page.locator("#content-main caption .section").all_text_contents()]
    assert groups == [
        "Fleet",
        "Jobs",
        "Costs",
        "GitHub Actions",
        "GitLab CI",
        "Organizations and access",
        "Records and the system",
    ], groups
    costs = page.locator("#content-main .app-costs").inner_text()
    assert "Cost per day" in costs and "Budgets" in costs
    system = page.locator("#content-main .app-records").inner_text()
    assert "Service heartbeats" in system and "Installation identity" in system
    assert page.inner_text("#cc-version") == catacloud.__version__
    assert overflow(page) == []
