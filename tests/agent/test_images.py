"""The machine's image store against a real registry on loopback (Debian's docker-registry,
behind a proxy that counts what it serves): one pull for two jobs at once, layers shared
between images, least recently used eviction within the budget (never an image in use),
``:latest`` asked again while other tags are not, a cancelled pull that leaves nothing, and
credentials that never reach a command line. And image references, parsed as registries do."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catacloud.agent.images import ImageError, ImageStore, PullCancelled, find_tools
from catacloud.agent.reference import parse, registry_host
from catacloud.protocol import ImageFailure, RegistryAuth
from testkit.registry import INSTALL, FaultyProxy, Registry, build_image, manifest, missing_tools, push

NEVER = threading.Event()


@pytest.fixture(scope="module")
def registry(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Registry, FaultyProxy, dict[str, Any]]]:
    if missing_tools():
        pytest.fail(f"images need {', '.join(missing_tools())}: {INSTALL}")
    work = tmp_path_factory.mktemp("store-registry")
    with Registry(work / "registry", users={"robot": "pa55word-xyz"}) as reg:
        base = build_image(work / "img", "base", files={"/base.bin": os.urandom(400_000)})
        child = build_image(work / "img", "child", base=base, files={"/child.bin": os.urandom(200_000)})
        other = build_image(work / "img", "other", files={"/other.bin": os.urandom(400_000)})
        third = build_image(work / "img", "third", files={"/third.bin": os.urandom(400_000)})
        creds = ("robot", "pa55word-xyz")
        digests = {
            name: push(img, f"{reg.host}/t/{name}:1", credentials=creds)
            for name, img in (("base", base), ("child", child), ("other", other), ("third", third))
        }
        push(base, f"{reg.host}/t/moving:latest", credentials=creds)
        proxy = FaultyProxy(reg.host).start()
        try:
            yield reg, proxy, {"digests": digests, "images": {"base": base, "other": other}, "work": work}
        finally:
            proxy.stop()


AUTH = RegistryAuth(username="robot", password="pa55word-xyz")


def store(tmp_path: Path, **kwargs: Any) -> ImageStore:
    tools = find_tools()
    assert not isinstance(tools, str), tools
    return ImageStore(str(tmp_path / "store"), tools=tools, mount_dirs=["/var/lib/catacloud/work"], **kwargs)


def ensure(s: ImageStore, ref: str, **kwargs: Any) -> Any:
    return s.ensure(parse(ref), auth=AUTH, deadline=time.monotonic() + 60, cancel=kwargs.pop("cancel", NEVER))


def test_two_jobs_asking_at_once_cause_one_pull(registry: Any, tmp_path: Path) -> None:
    reg, proxy, info = registry
    s = store(tmp_path)
    before = proxy.blob_gets()
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure(s, f"{proxy.host}/t/base:1"))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.pulled for r in results) == [False, True]
    assert {r.image.digest for r in results} == {info["digests"]["base"]}
    assert proxy.blob_gets() - before == 2  # its layer and its config, once
    assert (Path(results[0].image.rootfs) / "base.bin").stat().st_size == 400_000


def test_a_layer_two_images_share_is_fetched_once(registry: Any, tmp_path: Path) -> None:
    reg, proxy, info = registry
    s = store(tmp_path)
    ensure(s, f"{proxy.host}/t/base:1")
    before = proxy.blob_gets()
    child = ensure(s, f"{proxy.host}/t/child:1")
    assert child.pulled and proxy.blob_gets() - before == 2  # its own layer and config only
    assert {"base.bin", "child.bin"} <= set(os.listdir(child.image.rootfs))


def test_the_store_gives_a_blob_only_for_a_repository_whose_held_image_names_it(
    registry: Any, tmp_path: Path
) -> None:
    """What a containers job's engine may take from the store (catacloud/agent/registry_proxy.py):
    a config or layer of an image it holds, asked for under that image's repository; not the same
    blob under another repository, not a blob no held image names, not a made-up digest."""
    reg, proxy, info = registry
    s = store(tmp_path)
    ensure(s, f"{proxy.host}/t/base:1")
    layer = manifest(info["images"]["base"])["layers"][0]["digest"]
    config = manifest(info["images"]["base"])["config"]["digest"]
    for digest in (layer, config):
        path = s.blob_for(f"{proxy.host}/t/base", digest)
        assert (
            path is not None and hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest.split(":")[1]
        )
    assert s.blob_for(f"{proxy.host}/t/other", layer) is None  # another repository
    assert s.blob_for(f"{reg.host}/t/base", layer) is None  # another registry
    assert (
        s.blob_for(f"{proxy.host}/t/base", manifest(info["images"]["other"])["layers"][0]["digest"]) is None
    )
    assert s.blob_for(f"{proxy.host}/t/base", "sha256:../../index.json") is None
    assert s.registries() == {proxy.host}


def test_least_recently_used_images_go_first_never_one_in_use(registry: Any, tmp_path: Path) -> None:
    reg, proxy, info = registry
    s = store(tmp_path)
    base = ensure(s, f"{proxy.host}/t/base:1")
    other = ensure(s, f"{proxy.host}/t/other:1")
    s.budget_bytes = s.size() + 100_000  # room for these two, not a third
    ensure(s, f"{proxy.host}/t/base:1")  # base is now the more recently used
    with s.pinned(other.image.digest):  # ... but other is in use by a job
        third = ensure(s, f"{proxy.host}/t/third:1")
    held = {image.digest for image in s.held()}
    assert held == {other.image.digest, third.image.digest}  # base went, though used later
    assert not os.path.exists(base.image.rootfs)
    s.budget_bytes = s.size() + 100_000
    ensure(s, f"{proxy.host}/t/base:1")  # nothing pinned now: the least recently used goes
    assert {image.digest for image in s.held()} == {third.image.digest, info["digests"]["base"]}
    assert s.size() <= s.budget_bytes


def test_latest_is_asked_again_other_tags_are_not(registry: Any, tmp_path: Path) -> None:
    reg, proxy, info = registry
    s = store(tmp_path)
    ensure(s, f"{proxy.host}/t/base:1")
    ensure(s, f"{proxy.host}/t/moving")
    asked = proxy.manifest_requests()
    assert not ensure(s, f"{proxy.host}/t/base:1").pulled and proxy.manifest_requests() == asked
    push(info["images"]["other"], f"{reg.host}/t/moving:latest", credentials=("robot", "pa55word-xyz"))
    moved = ensure(s, f"{proxy.host}/t/moving:latest")
    assert moved.pulled and moved.image.digest == info["digests"]["other"]
    assert proxy.manifest_requests() > asked


def test_a_cancelled_pull_leaves_nothing(registry: Any, tmp_path: Path) -> None:
    reg, proxy, info = registry
    s = store(tmp_path)
    proxy.stall = 1
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    with pytest.raises(PullCancelled):
        ensure(s, f"{proxy.host}/t/third:1", cancel=cancel)
    proxy.stall = 0
    assert s.held() == [] and os.listdir(tmp_path / "store" / "tmp") == []
    blobs = tmp_path / "store" / "oci" / "blobs" / "sha256"
    assert not blobs.exists() or os.listdir(blobs) == []
    assert [p for p in os.listdir(tmp_path / "store" / "oci") if p.startswith("oci-put-blob")] == []


def test_credentials_reach_no_command_line_and_no_file_outlives_the_pull(
    registry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg, proxy, info = registry
    seen: list[list[str]] = []
    real = subprocess.Popen

    def spy(argv: list[str], *args: Any, **kwargs: Any) -> Any:
        seen.append(list(argv))
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    s = store(tmp_path)
    ensure(s, f"{reg.host}/t/other:1")
    assert seen and not any("pa55word" in " ".join(argv) for argv in seen)
    assert any("--authfile" in argv or "--src-authfile" in argv for argv in seen)
    private = tmp_path / "store" / "private"
    assert [p for p in os.listdir(private) if p.startswith("auth-")] == []
    assert oct(private.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(ImageError) as refused:
        s.ensure(parse(f"{reg.host}/t/third:1"), auth=None, deadline=time.monotonic() + 30, cancel=NEVER)
    assert refused.value.code == ImageFailure.AUTH_FAILED


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("debian", "docker.io/library/debian:latest"),
        ("debian:12", "docker.io/library/debian:12"),
        ("team/tool", "docker.io/team/tool:latest"),
        ("localhost/tool:1", "localhost/tool:1"),
        ("127.0.0.1:5000/a/b-c_d.e:v1.2", "127.0.0.1:5000/a/b-c_d.e:v1.2"),
        ("reg.example.com/x@sha256:" + "a" * 64, "reg.example.com/x@sha256:" + "a" * 64),
        ("reg.example.com/x:1@sha256:" + "b" * 64, "reg.example.com/x:1@sha256:" + "b" * 64),
    ],
)
def test_references_are_normalised_as_registries_read_them(text: str, canonical: str) -> None:
    assert str(parse(text)) == canonical


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Team/Tool",
        "reg.example.com/tool:",
        "tool@sha256:abc",
        "a b",
        "reg.example.com/-x",
        "x:-tag",
        "reg.example.com:99999/x",
        "x/" + "a" * 300,
        5,
    ],
)
def test_malformed_references_are_refused(text: object) -> None:
    with pytest.raises(ValueError):
        parse(text)


def test_registry_hosts_are_normalised() -> None:
    assert registry_host("https://Reg.Example.com:5000/") == "reg.example.com:5000"
    assert registry_host("index.docker.io") == "docker.io"
    with pytest.raises(ValueError):
        registry_host("reg.example.com/path")


def test_a_machine_whose_jobs_run_without_the_sandbox_says_it_runs_no_image(tmp_path: Path) -> None:
    from catacloud.agent.imagejob import JobImages

    images = JobImages(str(tmp_path / "store"), mount_dirs=[])
    if images.problem:
        pytest.fail(f"images need skopeo and umoci: {INSTALL}")
    assert images.describe()["images"] == "skopeo+umoci"
    uid_only = images.describe(sandboxed=False)
    assert uid_only["images"] == ""  # so the control plane sends it no image job
    assert "without the bubblewrap sandbox" in uid_only["images_detail"]
