"""Jobs as container images, end to end over REST: real registries on loopback (Debian's
docker-registry, one open, one behind htpasswd), images this test builds from busybox-static and
pushes with skopeo, the whole stack (worker, beat, local machines whose agents pull with skopeo
and unpack with umoci), and a proxy in front of a registry that counts, fails, cuts and stalls
what it serves."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from apps.events.models import Event
from apps.machines.models import MachineInstance
from testkit.registry import INSTALL, FaultyProxy, Registry, build_image, manifest, missing_tools, push
from tests.e2e.conftest import Stack
from tests.e2e.test_client_cli import Cli

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PASSWORD = "s3cret-registry-password-7f3a"


@dataclass
class Registries:
    open: Registry
    private: Registry
    proxy: FaultyProxy  # in front of ``open``
    digests: dict[str, str]
    work: Path

    def ref(self, name: str, *, via_proxy: bool = True) -> str:
        return f"{self.proxy.host if via_proxy else self.open.host}/{name}"


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registries]:
    if missing_tools():
        pytest.fail(f"images need {', '.join(missing_tools())}: {INSTALL}")
    work = tmp_path_factory.mktemp("registries")
    with (
        Registry(work / "open") as open_registry,
        Registry(work / "private", users={"robot": PASSWORD}) as private,
    ):
        tool = build_image(
            work / "img",
            "tool",
            files={"/srv/only-in-image.txt": b"a file only the image has\n"},
            env={"GREETING": "hello from the image"},
            workdir="/srv",
        )
        default = build_image(work / "img", "default", cmd=("sh", "-c", "echo ran-the-image-cmd $GREETING"))
        secret = build_image(work / "img", "secret", files={"/secret.txt": b"private image content\n"})
        shell_less = build_image(work / "img", "noshell", with_shell=False)
        mismatch = build_image(work / "img", "mismatch", files={"/data.bin": os.urandom(300_000)})
        digests = {
            "tool": push(tool, f"{open_registry.host}/team/tool:1"),
            "default": push(default, f"{open_registry.host}/team/default:1"),
            "broken": push(tool, f"{open_registry.host}/team/broken:1"),
            "noshell": push(shell_less, f"{open_registry.host}/team/noshell:1"),
            "mismatch": push(mismatch, f"{open_registry.host}/team/mismatch:1"),
            "secret": push(secret, f"{private.host}/team/secret:1", credentials=("robot", PASSWORD)),
        }
        digests["mismatch-layer"] = manifest(mismatch)["layers"][-1]["digest"]
        proxy = FaultyProxy(open_registry.host).start()
        try:
            yield Registries(open_registry, private, proxy, digests, work)
        finally:
            proxy.stop()


def job_config(stack: Stack, name: str, command: str, **fields: Any) -> str:
    body = {"name": name, "machine_type": str(stack.world.machine_type.pk), "command": command, **fields}
    response = stack.api("admin").post("/api/v1/job-configs/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def submit(stack: Stack, config_id: str, **fields: Any) -> str:
    response = stack.api("member").post("/api/v1/jobs/", {"config": config_id, **fields}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def job(stack: Stack, job_id: str) -> dict:
    return stack.api("viewer").get(f"/api/v1/jobs/{job_id}/").json()


def ended(stack: Stack, job_id: str, timeout: float = 90) -> dict:
    return stack.wait(lambda: (j := job(stack, job_id))["finished_at"] and j, timeout, f"job {job_id} to end")


def logs(stack: Stack, job_id: str) -> str:
    return stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/").json()["text"]


def events(job_id: str) -> dict[str, dict]:
    return {
        e.kind: {**e.data, "reason": e.reason} for e in Event.objects.filter(job_id=job_id).order_by("id")
    }


def test_an_image_job_runs_inside_its_image_and_the_next_one_does_not_pull_again(
    stack: Stack, registries: Registries, tmp_path: Path
) -> None:
    ref = registries.ref("team/tool:1")
    command = (
        'cat /etc/os-release; cat only-in-image.txt; pwd; echo "$GREETING"; id -u; '
        "test -e /usr/bin/python3 || echo no-host-python; echo result > $CATACLOUD_OUTPUT_DIR/r.txt"
    )
    cfg = job_config(stack, "in-image", command, image=ref)
    first = ended(stack, submit(stack, cfg))
    text = logs(stack, first["id"])
    assert first["status"] == "succeeded", (first, text)
    # /etc/os-release and a file only the image has: it ran inside the image, in its WorkingDir,
    # with its Env, as a uid of its own (never root), without the machine's root
    assert "ID=catacloud-test" in text and "a file only the image has" in text, text
    assert "/srv\nhello from the image\n" in text and "no-host-python" in text
    assert "\n0\n" not in text
    assert first["image"] == ref and first["image_digest"] == registries.digests["tool"]
    pulled = events(first["id"])["job.image_pulled"]
    assert (
        pulled["digest"] == registries.digests["tool"] and pulled["bytes"] > 500_000 and pulled["seconds"] > 0
    )
    stack.wait(  # its outputs are kept as every job's (uploaded once it reported its end)
        lambda: (
            [a["name"] for a in stack.api("viewer").get(f"/api/v1/jobs/{first['id']}/artifacts/").json()]
            == ["r.txt"]
        ),
        30,
        "the job's output file",
    )

    blobs_before = registries.proxy.blob_gets()
    second = ended(stack, submit(stack, cfg))
    assert second["status"] == "succeeded" and "ID=catacloud-test" in logs(stack, second["id"])
    assert second["instance"] == first["instance"]  # kept for reuse, and it holds the image
    kinds = events(second["id"])
    assert "job.image_cached" in kinds and "job.image_pulled" not in kinds
    assert registries.proxy.blob_gets() == blobs_before  # not one layer fetched again
    instance = stack.api("viewer").get(f"/api/v1/instances/{first['instance']}/").json()
    assert ref in instance["images"] and instance["isolation"]["images"] == "skopeo+umoci"

    # no command: the image's own Cmd runs; a job's image overrides its configuration's
    bare = job_config(stack, "image-cmd", "", image=registries.ref("team/default:1"))
    done = ended(stack, submit(stack, bare))
    assert done["status"] == "succeeded" and "ran-the-image-cmd" in logs(stack, done["id"]), logs(
        stack, done["id"]
    )
    other = ended(stack, submit(stack, cfg, image=registries.ref("team/default:1")))
    assert other["image"] == registries.ref("team/default:1") and "/etc/os-release" not in logs(
        stack, other["id"]
    )

    # the CLI shows the image and its digest
    shown = Cli(stack.url, tmp_path)(stack.world.tokens["viewer"], "jobs", "show", first["id"])
    assert shown.returncode == 0, shown.stderr
    assert registries.digests["tool"] in shown.stdout and "job.image_pulled" in shown.stdout, shown.stdout


def test_a_private_image_needs_the_organizations_credentials(stack: Stack, registries: Registries) -> None:
    ref = f"{registries.private.host}/team/secret:1"
    cfg = job_config(stack, "private", "cat /secret.txt", image=ref, max_attempts=3)
    refused = ended(stack, submit(stack, cfg))
    assert refused["status"] == "failed" and refused["failure_code"] == "image_auth_failed", refused
    assert refused["attempt"] == 1  # ended at once: no attempt burned on retries

    admin, viewer = stack.api("admin"), stack.api("viewer")
    body = {"registry": registries.private.host, "username": "robot", "password": PASSWORD}
    assert stack.api("member").post("/api/v1/registry-credentials/", body, format="json").status_code == 403
    created = admin.post("/api/v1/registry-credentials/", body, format="json")
    assert created.status_code == 201 and "password" not in created.json(), created.content
    listed = viewer.get("/api/v1/registry-credentials/").json()
    assert listed["results"][0]["registry"] == registries.private.host and PASSWORD not in json.dumps(listed)

    done = ended(stack, submit(stack, cfg))
    assert done["status"] == "succeeded" and logs(stack, done["id"]) == "private image content\n"
    assert done["image_digest"] == registries.digests["secret"]
    # the password is nowhere a user or a job can read: answers, events, logs, the job's env
    seen = json.dumps(
        [viewer.get(f"/api/v1/jobs/{done['id']}/").json(), viewer.get("/api/v1/events/").json()]
    )
    assert PASSWORD not in seen and PASSWORD not in logs(stack, done["id"])
    snoop = ended(stack, submit(stack, job_config(stack, "snoop", "env; ls -a / /run/catacloud", image=ref)))
    assert snoop["status"] == "succeeded" and PASSWORD not in logs(stack, snoop["id"])
    assert "robot" not in logs(stack, snoop["id"])
    # a job on the machine's own root finds nothing of the store (its layers, its auth files)
    peek = ended(
        stack, submit(stack, job_config(stack, "peek", "ls -a /var/lib/catacloud/images; echo listed"))
    )
    assert peek["instance"] == done["instance"] and peek["status"] == "succeeded"
    seen_there = logs(stack, peek["id"])  # (the machine's folder is hidden whole: no such file)
    assert "listed" in seen_there and not {"index.json", "oci", "private"} & set(seen_there.split()), (
        seen_there
    )
    # another organization's credentials are not this one's
    rival = stack.world.client("outsider").get("/api/v1/registry-credentials/").json()
    assert rival["results"] == []


def test_bad_references_are_refused_at_submission(stack: Stack) -> None:
    admin = stack.api("admin")
    before = admin.get("/api/v1/job-configs/").json()["count"]
    for bad in ("Team/Tool:1", "registry.example.com/tool:", "tool@sha256:abc", "a b"):
        body = {
            "name": "bad",
            "machine_type": str(stack.world.machine_type.pk),
            "command": "true",
            "image": bad,
        }
        answer = admin.post("/api/v1/job-configs/", body, format="json")
        assert answer.status_code == 400, (bad, answer.content)
        assert answer.json()["code"] == "invalid_image_reference" and "image" in answer.json()["fields"]
    assert admin.get("/api/v1/job-configs/").json()["count"] == before  # nothing half-written
    cfg = job_config(stack, "plain", "true")
    answer = stack.api("member").post("/api/v1/jobs/", {"config": cfg, "image": "UPPER/case"}, format="json")
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_image_reference"
    assert stack.api("viewer").get("/api/v1/jobs/").json()["count"] == 0
    empty = {"name": "empty", "machine_type": str(stack.world.machine_type.pk), "command": " "}
    assert admin.post("/api/v1/job-configs/", empty, format="json").status_code == 400


def test_image_faults_end_the_job_with_a_code_or_are_retried(stack: Stack, registries: Registries) -> None:
    proxy = registries.proxy

    # an image that does not exist, and one without /bin/sh: at once, one attempt
    for image, code in (("team/missing:1", "image_not_found"), ("team/noshell:1", "image_unusable")):
        failed = ended(stack, submit(stack, job_config(stack, code, "true", image=registries.ref(image))))
        assert (failed["status"], failed["failure_code"], failed["attempt"]) == ("failed", code, 1), failed

    # a registry answering 503 and cutting a layer's transfer: retried, and the job runs
    proxy.fail, proxy.cut = 2, 1
    flaky = ended(
        stack,
        submit(stack, job_config(stack, "flaky", "echo made-it", image=registries.ref("team/broken:1"))),
    )
    assert flaky["status"] == "succeeded" and "made-it" in logs(stack, flaky["id"]), (
        flaky,
        logs(stack, flaky["id"]),
    )
    assert proxy.fail == proxy.cut == 0

    # a blob whose content fails its digest: refused, nothing of it kept
    layer = registries.open.blob_paths(registries.digests["mismatch-layer"])
    original = layer.read_bytes()
    corrupt = bytearray(original)
    corrupt[len(corrupt) // 2] ^= 0xFF
    layer.write_bytes(bytes(corrupt))
    try:
        bad = ended(
            stack,
            submit(stack, job_config(stack, "corrupt", "true", image=registries.ref("team/mismatch:1"))),
        )
    finally:
        layer.write_bytes(original)
    assert bad["failure_code"] == "image_digest_mismatch", bad

    # a pull that outlives its deadline (the job's timeout): failed, and the machine's store cleaned
    proxy.stall = 1
    slow = job_config(stack, "stalled", "true", image=registries.ref("team/default:2"), timeout_seconds=4)
    push_default = registries.digests["default"]
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            f"docker://{registries.open.host}/team/default:1",
            f"docker://{registries.open.host}/team/default:2",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    stalled = ended(stack, submit(stack, slow))
    assert stalled["failure_code"] == "image_pull_timeout", stalled
    store = Path(stack.world.account.config["state_dir"]) / stalled["instance"] / "images"
    leftovers = [p.name for p in (store / "oci").iterdir() if p.name.startswith("oci-put-blob")]
    assert leftovers == [] and list((store / "tmp").iterdir()) == []
    held = json.loads((store / "index.json").read_text())["images"]
    assert push_default not in held or "team/default:2" not in json.dumps(held[push_default])
    proxy.stall = 0


def test_too_large_for_the_machine_types_budget(stack: Stack, registries: Registries) -> None:
    from apps.machines.services import machine_type_update

    machine_type_update(machine_type=stack.world.machine_type, actor="test", image_cache_mb=1)
    cfg = job_config(stack, "big", "true", image=registries.ref("team/tool:1"), max_attempts=3)
    big = ended(stack, submit(stack, cfg))
    assert (big["status"], big["failure_code"], big["attempt"]) == ("failed", "image_too_large", 1), big
    assert "image_cache_mb" in big["failure_reason"]


def test_a_pool_keeps_its_images_hot_and_rolls_when_they_change(stack: Stack, registries: Registries) -> None:
    ref = registries.ref("team/tool:1")
    admin = stack.api("admin")
    created = admin.post(
        "/api/v1/pools/",
        {"name": "hot", "machine_type": str(stack.world.machine_type.pk), "target_size": 1, "images": [ref]},
        format="json",
    )
    assert created.status_code == 201, created.content
    pool_id = created.json()["id"]
    member = stack.wait(
        lambda: MachineInstance.objects.filter(pool_id=pool_id, status="ready").first(), 90, "a ready member"
    )
    assert ref in member.images  # pulled before it was ready
    pulled, warmed = (
        Event.objects.filter(instance_id=member.pk, kind=kind).values_list("id", flat=True).first()
        for kind in ("instance.image_pulled", "pool.member_warmed")
    )
    assert pulled is not None and warmed is not None and pulled < warmed

    blobs = registries.proxy.blob_gets()
    cfg = job_config(stack, "hot-job", "cat /etc/os-release", image=ref)
    done = ended(stack, submit(stack, cfg))
    assert done["status"] == "succeeded" and done["instance"] == str(member.pk)
    assert "job.image_cached" in events(done["id"]) and registries.proxy.blob_gets() == blobs

    # new images: the members told the old list are replaced, as template drift
    changed = admin.patch(
        f"/api/v1/pools/{pool_id}/", {"images": [registries.ref("team/default:1")]}, format="json"
    )
    assert changed.status_code == 200 and changed.json()["images"] == [registries.ref("team/default:1")]
    fresh = stack.wait(
        lambda: (
            MachineInstance.objects.filter(pool_id=pool_id, status="ready", outdated=False)
            .exclude(pk=member.pk)
            .first()
        ),
        120,
        "a member with the new images",
    )
    assert registries.ref("team/default:1") in fresh.images and ref not in fresh.images

    def rolled() -> bool:
        live = MachineInstance.objects.filter(pool_id=pool_id).exclude(
            status__in=["terminating", "terminated"]
        )
        return all(
            not m.outdated and registries.ref("team/default:1") in m.images
            for m in live
            if m.status == "ready"
        )

    stack.wait(rolled, 120, "every ready member to hold the new images")
