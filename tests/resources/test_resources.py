"""Managed resources: ordered acquisition, back pressure, release, and each well against a
real counterpart (Catacloud's own API, a real PostgreSQL server, a local HTTP server)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from apps.events.models import Event
from apps.jobs.acquisition import job_acquire_resources
from apps.jobs.admission import admit
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job, JobConfiguration
from apps.jobs.submission import job_cancel, job_submit
from apps.orgs.models import Privilege
from apps.resources.lifecycle import release_for_job, resource_destroy
from apps.resources.models import ResourceInstance, ResourceType
from apps.resources.wells import WellPermanent, WellTransient, build_well
from testkit.builders import job_config, job_row
from testkit.servers import JsonServer
from tests.conftest import World

pytestmark = pytest.mark.django_db
J = JobStatus


def config_with(world: World, *type_ids: str, name: str = "needs") -> JobConfiguration:
    return job_config(world.org, world.machine_type, name, "x", resource_types=type_ids)


def admitted_job(world: World, config: JobConfiguration) -> Job:
    job = job_submit(org=world.org, config=config, user=world.users["member"])
    admit()
    job.refresh_from_db()
    assert job.status == J.ACQUIRING_RESOURCES
    return job


def release(job: Job) -> None:
    release_for_job(job_id=job.pk, reason="test")
    for resource in ResourceInstance.objects.filter(job=job, status="releasing"):
        resource_destroy(resource_id=resource.pk)


def test_resources_are_acquired_in_lexicographic_order_before_a_machine(world: World) -> None:
    for type_id in ("zeta-token", "alpha-token"):
        ResourceType.objects.create(id=type_id, well="api_token")
    job = admitted_job(world, config_with(world, "zeta-token", "alpha-token"))
    assert job_acquire_resources(job_id=job.pk) == "done"
    job.refresh_from_db()
    assert job.status == J.WAITING_FOR_MACHINE
    order = list(
        Event.objects.filter(kind="resource.requested", job_id=job.pk)
        .order_by("id")
        .values_list("data__resource_type", flat=True)
    )
    assert order == ["alpha-token", "zeta-token"]
    assert set(ResourceInstance.objects.filter(job=job).values_list("status", flat=True)) == {"held"}


def test_back_pressure_the_third_job_waits_naming_the_resource_type(world: World) -> None:
    ResourceType.objects.create(id="lab-db", well="api_token", max_instances=2)
    config = config_with(world, "lab-db")
    jobs = [admitted_job(world, config) for _ in range(3)]
    results = [job_acquire_resources(job_id=j.pk) for j in jobs]
    assert results == ["done", "done", "waiting"]
    jobs[2].refresh_from_db()
    assert jobs[2].status == J.ACQUIRING_RESOURCES
    assert jobs[2].pending_reason == "waiting for resource lab-db (2/2 in use)"
    release(jobs[0])  # the first job ends: its slot frees
    assert job_acquire_resources(job_id=jobs[2].pk) == "done"


def test_cancelling_a_job_releases_what_it_holds(world: World) -> None:
    ResourceType.objects.create(id="tok", well="api_token")
    job = admitted_job(world, config_with(world, "tok"))
    job_acquire_resources(job_id=job.pk)
    job_cancel(job=Job.objects.get(pk=job.pk))
    assert set(ResourceInstance.objects.filter(job=job).values_list("status", flat=True)) == {"releasing"}


def test_a_privileged_resource_type_is_refused_at_submit(world: World) -> None:
    lab = Privilege.objects.create(name="lab")
    ResourceType.objects.create(id="rack", well="api_token", required_privilege=lab)
    config = config_with(world, "rack")
    world.org.privileges.add(lab)  # the org had it when the configuration was made…
    world.org.privileges.remove(lab)  # …and lost it since
    response = world.client("member").post("/api/v1/jobs/", {"config": str(config.pk)}, format="json")
    assert response.status_code == 403 and response.json()["code"] == "missing_privilege"
    assert not Job.objects.exists()


# ---- the api_token well against Catacloud's own API ---------------------------------------------


def test_the_token_well_reads_its_own_job_only_and_dies_with_it(world: World) -> None:
    ResourceType.objects.create(id="self-token", well="api_token")
    job = admitted_job(world, config_with(world, "self-token"))
    other = job_submit(org=world.org, config=config_with(world, name="other"))
    job_acquire_resources(job_id=job.pk)
    resource = ResourceInstance.objects.get(job=job)
    token = resource.secret["token"]
    assert token not in json.dumps(resource.metadata) and token not in resource.secret_encrypted
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get(f"/api/v1/jobs/{job.pk}/").json()["id"] == str(job.pk)
    events = client.get("/api/v1/events/").json()["results"]
    assert events and {e["job_id"] for e in events} == {str(job.pk)}
    assert client.get(f"/api/v1/jobs/{other.pk}/").status_code == 404
    assert client.get("/api/v1/jobs/").status_code == 403
    assert client.get("/api/v1/pools/").status_code == 403
    assert client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 403
    # The API never shows the secret part.
    listed = world.client("viewer").get("/api/v1/resources/").json()["results"][0]
    assert listed["status"] == "held" and token not in json.dumps(listed)
    release(job)  # the job ends
    assert client.get(f"/api/v1/jobs/{job.pk}/").status_code == 401


# ---- the postgres_database well against a real PostgreSQL server -------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_database_well_connects_during_the_job_and_is_gone_after(tworld: World) -> None:
    ResourceType.objects.create(
        id="scratch-db", well="postgres_database", config={"use_catacloud_database": True}
    )
    job = admitted_job(tworld, config_with(tworld, "scratch-db"))
    assert job_acquire_resources(job_id=job.pk) == "done"
    resource = ResourceInstance.objects.get(job=job)
    dsn = resource.secret["dsn"]
    with psycopg.connect(dsn) as conn:  # the job's DSN works, as its own user
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (42)")
        assert conn.execute("SELECT current_user").fetchone()[0] == resource.metadata["user"]
    release(job)
    from testkit.processes import database_url

    with psycopg.connect(database_url()) as admin:
        assert not admin.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [resource.metadata["dbname"]]
        ).fetchone()
        assert not admin.execute(
            "SELECT 1 FROM pg_roles WHERE rolname = %s", [resource.metadata["user"]]
        ).fetchone()
    resource.refresh_from_db()
    assert resource.status == "destroyed" and resource.secret_encrypted == ""


# ---- the webhook well against a local HTTP server ---------------------------------------------


class Rack(JsonServer):
    """A pretend external system: creates accounts; its destroy fails the first times."""

    def __init__(self, destroy_failures: int) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.destroy_failures = destroy_failures
        super().__init__(self.respond)

    def respond(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.calls.append((path, body))
        if path == "/create":
            return 200, {
                "id": f"acct-{body['resource_id'][:8]}",
                "metadata": {"account": "a1"},
                "secret": {"password": "pw"},
            }
        if self.destroy_failures > 0:
            self.destroy_failures -= 1
            return 503, {"error": "busy"}
        return 200, {}


@pytest.fixture
def rack() -> Iterator[Rack]:
    server = Rack(destroy_failures=2)
    yield server
    server.close()


LOOPBACK = override_settings(CATACLOUD_WEBHOOK_ALLOW_NETWORKS=["127.0.0.1/32"])


@LOOPBACK
def test_the_webhook_well_creates_and_retries_a_failing_destroy_until_it_succeeds(
    world: World, rack: Rack
) -> None:
    urls = {"create_url": f"{rack.url}/create", "destroy_url": f"{rack.url}/destroy"}
    ResourceType.objects.create(id="rack", well="webhook", config=urls)
    job = admitted_job(world, config_with(world, "rack"))
    assert job_acquire_resources(job_id=job.pk) == "done"
    resource = ResourceInstance.objects.get(job=job)
    assert resource.metadata == {"account": "a1"} and resource.secret == {"password": "pw"}
    release_for_job(job_id=job.pk, reason="job ended")
    attempts = 0
    while True:  # what destroy_resource_task does: retry transient failures with backoff
        attempts += 1
        try:
            resource_destroy(resource_id=resource.pk)
            break
        except WellTransient:
            assert attempts < 10
    resource.refresh_from_db()
    assert resource.status == "destroyed"
    assert attempts == 3
    destroys = [c for c in rack.calls if c[0] == "/destroy"]
    assert len(destroys) == 3 and destroys[-1][1]["id"] == resource.external_id


def test_the_reaper_destroys_resources_whose_job_is_gone(world: World) -> None:
    from apps.jobs.acquisition import resources_safety_net

    ResourceType.objects.create(id="tok2", well="api_token")
    job = admitted_job(world, config_with(world, "tok2"))
    job_acquire_resources(job_id=job.pk)
    Job.objects.filter(pk=job.pk).update(status=J.FAILED)  # ended without releasing (a crash)
    from apps.core.repairs import InlineRepairs

    report = resources_safety_net(repairs=InlineRepairs())
    assert report["released_orphans"] == 1
    assert ResourceInstance.objects.get(job=job).status == "releasing"
    # Still releasing a tick later (its destroy message lost): the tick destroys it itself.
    later = timezone.now() + timedelta(seconds=settings.CATACLOUD_REAPER_INTERVAL + 1)
    assert resources_safety_net(now=later, repairs=InlineRepairs())["destroying"] == 1
    assert ResourceInstance.objects.get(job=job).status == "destroyed"


def test_resource_types_show_use_and_whether_the_org_may_use_them(world: World) -> None:
    lab = Privilege.objects.create(name="lab")
    ResourceType.objects.create(id="open", well="api_token", max_instances=3)
    ResourceType.objects.create(id="locked", well="api_token", required_privilege=lab)
    job = admitted_job(world, config_with(world, "open"))
    job_acquire_resources(job_id=job.pk)
    rows = {r["id"]: r for r in world.client("viewer").get("/api/v1/resource-types/").json()["results"]}
    assert (rows["open"]["in_use"], rows["open"]["max_instances"], rows["open"]["usable"]) == (1, 3, True)
    assert (rows["locked"]["usable"], rows["locked"]["required_privilege"]) == (False, "lab")
    world.org.privileges.add(lab)
    rows = {r["id"]: r for r in world.client("viewer").get("/api/v1/resource-types/").json()["results"]}
    assert rows["locked"]["usable"] is True


@LOOPBACK
def test_the_webhook_well_never_follows_a_redirect(world: World) -> None:
    """A far side answering 307 to an internal address had the well replay its POST (headers
    and all) there."""
    internal = Rack(destroy_failures=0)  # what must never be reached
    far = JsonServer(lambda path, body: (307, {}, {"Location": f"{internal.url}{path}"}))
    try:
        urls = {"create_url": f"{far.url}/create", "destroy_url": f"{far.url}/destroy"}
        ResourceType.objects.create(id="hop", well="webhook", config=urls)
        job = admitted_job(world, config_with(world, "hop"))
        job_acquire_resources(job_id=job.pk)
        resource = ResourceInstance.objects.get(job=job)
        assert resource.status == "failed" and "redirects are not followed" in resource.failure_reason
        job.refresh_from_db()
        assert job.status == J.FAILED
        with pytest.raises(WellPermanent, match="307"):
            build_well("webhook", urls).destroy(resource_id=str(resource.pk), external_id="x", job_id=None)
        assert internal.calls == []
    finally:
        far.close()
        internal.close()


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3", "0.0.0.0"]
)
def test_the_webhook_well_refuses_addresses_that_are_not_public(world: World, rack: Rack, host: str) -> None:
    """Loopback, private and link-local targets (the metadata service) are refused unless the
    operator lists their network; refused at connect time, so a name resolving there is too."""
    port = rack.url.rsplit(":", 1)[1]
    urls = {"create_url": f"http://{host}:{port}/create", "destroy_url": f"http://{host}:{port}/destroy"}
    well = build_well("webhook", {**urls, "timeout": 2})
    job = job_row(config_with(world), status="queued")
    with pytest.raises(WellPermanent, match="not a public address"):
        well.create(resource_id=str(uuid.uuid4()), job=job)
    assert rack.calls == []
    if host in ("127.0.0.1", "localhost"):
        with override_settings(CATACLOUD_WEBHOOK_ALLOW_NETWORKS=["127.0.0.0/8"]):
            well.create(resource_id=str(uuid.uuid4()), job=job)
        assert [path for path, _ in rack.calls] == ["/create"]


def test_webhook_addresses_public_or_allowed() -> None:
    from apps.resources.wells.webhook import refused_address

    assert not refused_address("93.184.215.14") and not refused_address("2606:4700::1111")
    for ip in ("127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1"):
        assert refused_address(ip), ip
    for ip in ("::1", "fe80::1", "fd00::1", "::ffff:10.0.0.1", "224.0.0.1", "0.0.0.0"):
        assert refused_address(ip), ip
    # IPv4 inside IPv6, which Python's is_global calls public: refused as jobs' rules refuse it.
    for ip in ("::127.0.0.1", "64:ff9b::169.254.169.254", "64:ff9b::10.0.0.1", "2002:a00:1::1", "5f00::1"):
        assert refused_address(ip), ip
    assert not refused_address("64:ff9b::8.8.8.8")  # NAT64 of a public address: the internet
    with override_settings(CATACLOUD_WEBHOOK_ALLOW_NETWORKS=["10.20.0.0/16"]):
        assert not refused_address("10.20.3.4") and refused_address("10.21.0.1")
