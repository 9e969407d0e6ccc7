"""The agent's registry mirror for containers jobs (catacloud/agent/registry_proxy.py), driven by
a real client (skopeo, what the engine's containers/image library is) against real registries
(Debian's docker-registry behind Basic auth, or behind a token service as Docker Hub and GHCR
are): pulls work with the organization's credentials, and nothing else does."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from catacloud.agent.netns import Allow, Policy
from catacloud.agent.registry_proxy import MAX_PER_GRANT, Login, RegistryProxy
from testkit.registry import BuiltImage, FaultyProxy, Registry, build_image, manifest, missing_tools, push

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"no registry tools: {missing_tools()}")

PASSWORD = "mirror-test-password-4c1e"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    return build_image(tmp_path_factory.mktemp("mirror") / "image", "1")


@pytest.fixture
def proxy() -> Iterator[RegistryProxy]:
    running = RegistryProxy()
    yield running
    running.close()


def reaching(*entries: str) -> Policy:
    """A job's network that reaches the internet and these allow entries."""
    return Policy(allow=tuple(Allow.parse(e) for e in entries))


def skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=60)


# What a client accepts for a manifest (the registry answers 404 for an OCI one otherwise).
ACCEPT = {"Accept": "application/vnd.oci.image.manifest.v1+json"}


def get(url: str, method: str = "GET") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, headers=ACCEPT)) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _read(url: str) -> None:
    """Fetch ``url`` to its end, whatever comes (a stalled blob's half, a cut)."""
    with contextlib.suppress(OSError, http.client.HTTPException), urllib.request.urlopen(url) as answer:
        answer.read()


def _url(mirror: str) -> str:
    """host:port/v2/<grant>/<key>: where a client asks the mirror location ``mirror`` for a name."""
    host, path = mirror.split("/", 1)
    return f"{host}/v2/{path}"


def test_a_token_registry_is_pulled_through_the_mirror_with_a_pull_only_token(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy
) -> None:
    """Docker Hub's and GHCR's way: the registry's 401 names a token service; the mirror asks it
    for ``repository:NAME:pull`` alone with the organization's login, and the pull completes."""
    with Registry(tmp_path / "registry", users={"robot": PASSWORD}, token=True) as registry:
        digest = push(image, f"{registry.host}/team/app:1", credentials=("robot", PASSWORD))
        assert registry.tokens is not None
        pushed_scopes = len(registry.tokens.scopes)
        direct = skopeo("inspect", "--tls-verify=false", f"docker://{registry.host}/team/app:1")
        assert direct.returncode != 0 and "unauthorized" in direct.stderr.lower(), direct.stderr

        login = Login(registry.host, "robot", PASSWORD, plain_http=True)
        service = f"127.0.0.1:{registry.tokens.port}"  # on the internet, for a real registry
        grant, [(_, mirror)] = proxy.grant([login], reaching(registry.host, service))
        copied = skopeo(
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            f"docker://{mirror}/team/app:1",
            f"oci:{tmp_path / 'out'}:1",
        )
        assert copied.returncode == 0, copied.stderr
        index = json.loads((tmp_path / "out" / "index.json").read_text())
        assert index["manifests"][0]["digest"] == digest  # what was pushed, byte for byte
        asked = registry.tokens.scopes[pushed_scopes:]
        assert asked and all(s == "repository:team/app:pull" for s in asked), asked

        proxy.revoke(grant)  # the job ended: its grant names nothing any more
        gone = skopeo("inspect", "--tls-verify=false", f"docker://{mirror}/team/app:1")
        assert gone.returncode != 0 and "name unknown" in gone.stderr.lower(), gone.stderr


def test_a_public_repository_is_pulled_with_an_anonymous_token_and_its_blobs_seeded(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy
) -> None:
    """Docker Hub's public pulls: no credentials, yet the registry wants a token, which its token
    service gives anyone for ``pull``. And a blob the machine's store holds for that repository
    (the ``seed``) is served from there: the registry never sees it asked for."""
    with Registry(
        tmp_path / "registry", users={"robot": PASSWORD}, token=True, anonymous_pulls=True
    ) as registry:
        push(image, f"{registry.host}/library/app:1", credentials=("robot", PASSWORD))
        assert registry.tokens is not None
        layer = manifest(image)["layers"][0]["digest"]
        held = tmp_path / "held-layer"
        held.write_bytes((image.layout / "blobs" / "sha256" / layer.split(":")[1]).read_bytes())
        asked: list[tuple[str, str]] = []

        def seed(repository: str, digest: str) -> str | None:
            asked.append((repository, digest))
            return str(held) if (repository, digest) == (f"{counting.host}/library/app", layer) else None

        counting = FaultyProxy(registry.host).start()
        try:
            service = f"127.0.0.1:{registry.tokens.port}"
            login = Login(counting.host, plain_http=True)  # no credentials at all
            _, [(_, mirror)] = proxy.grant([login], reaching(counting.host, service), seed)
            pushed = len(registry.tokens.scopes)
            copied = skopeo(
                "copy",
                "--quiet",
                "--src-tls-verify=false",
                f"docker://{mirror}/library/app:1",
                f"oci:{tmp_path / 'out'}:1",
            )
            assert copied.returncode == 0, copied.stderr
            assert (f"{counting.host}/library/app", layer) in asked
            assert not any(layer in r for r in counting.requests), counting.requests  # from the store
            assert counting.blob_gets() == 1  # the config, which the store did not hold
            assert set(registry.tokens.scopes[pushed:]) == {"repository:library/app:pull"}
            # a resumed download of the seeded layer: the bytes asked, as a registry gives them
            ranged = urllib.request.Request(f"http://{_url(mirror)}/library/app/blobs/{layer}")
            ranged.add_header("Range", "bytes=10-19")
            with urllib.request.urlopen(ranged) as part:
                assert part.status == 206 and part.headers["Content-Range"].startswith("bytes 10-19/")
                assert part.read() == held.read_bytes()[10:20]
        finally:
            counting.stop()


def test_the_mirror_pulls_only_and_only_for_its_grant(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy
) -> None:
    with Registry(tmp_path / "registry", users={"robot": PASSWORD}) as registry:
        push(image, f"{registry.host}/team/app:1", credentials=("robot", PASSWORD))
        login = Login(registry.host, "robot", PASSWORD, plain_http=True)
        grant, [(_, mirror)] = proxy.grant([login], reaching(registry.host))
        base = f"http://127.0.0.1:{proxy.port}/v2"
        assert get(f"{base}/")[0] == 200  # the version check every client makes
        status, _ = get(f"http://{_url(mirror)}/team/app/manifests/1", "HEAD")
        assert status == 200  # Basic auth added for it
        for method in ("POST", "PUT", "PATCH", "DELETE"):  # a push's first step, and the others
            status, body = get(f"{base}/{grant}/r0/team/app/blobs/uploads/", method)
            assert status == 405 and body["errors"][0]["code"] == "UNSUPPORTED", (method, body)
        strangers = [
            f"{base}/{'0' * 40}/r0/team/app/manifests/1",  # another grant
            f"{base}/{grant}/r1/team/app/manifests/1",  # a registry it holds no login for
            f"{base}/{grant}/r0/team/../../v2/team/app/manifests/1",  # out of its registry
            f"{base}/{grant}/r0/team/app/blobs/uploads/",  # not a pull endpoint
            f"{base}/team/app/manifests/1",  # the registry's own path, without a grant
        ]
        for url in strangers:
            status, body = get(url)
            assert status == 404 and body["errors"][0]["code"] == "NAME_UNKNOWN", (url, body)


def test_a_registry_the_jobs_network_may_not_reach_is_not_fetched_from(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy
) -> None:
    """The agent connects from the machine's network, but only where the job's own would: a
    registry on the host's loopback that the job's machine type does not allow is refused."""
    with Registry(tmp_path / "registry", users={"robot": PASSWORD}) as registry:
        push(image, f"{registry.host}/team/app:1", credentials=("robot", PASSWORD))
        login = Login(registry.host, "robot", PASSWORD, plain_http=True)
        _, [(_, mirror)] = proxy.grant([login], reaching())  # the internet alone
        status, body = get(f"http://{_url(mirror)}/team/app/manifests/1")
        assert status == 502 and "outside what this job's network may reach" in body["errors"][0]["message"]
        pulled = skopeo("inspect", "--tls-verify=false", f"docker://{mirror}/team/app:1")
        assert pulled.returncode != 0


def test_one_jobs_engine_holds_at_most_its_share_of_the_mirror(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy
) -> None:
    """A job that opens pull after pull against a registry that never answers (a stalled blob)
    gets 429 beyond :data:`MAX_PER_GRANT` in flight; another job's grant is not held up by it."""
    import threading

    with Registry(tmp_path / "registry") as registry:
        push(image, f"{registry.host}/team/app:1")
        stalling = FaultyProxy(registry.host).start()
        try:
            stalling.stall = 10**6
            login = Login(stalling.host, "robot", PASSWORD, plain_http=True)
            _, [(_, mirror)] = proxy.grant([login], reaching(stalling.host))
            _, [(_, other)] = proxy.grant([login], reaching(stalling.host))
            blob = f"/team/app/blobs/{manifest(image)['layers'][0]['digest']}"  # held: it stalls
            held = [
                threading.Thread(target=_read, args=(f"http://{_url(mirror)}{blob}",), daemon=True)
                for _ in range(MAX_PER_GRANT)
            ]
            for thread in held:
                thread.start()
            deadline = time.monotonic() + 10
            while stalling.blob_gets() < MAX_PER_GRANT and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stalling.blob_gets() == MAX_PER_GRANT
            status, body = get(f"http://{_url(mirror)}{blob}")
            assert status == 429 and body["errors"][0]["code"] == "TOOMANYREQUESTS", body
            status, _ = get(f"http://{_url(other)}/team/app/manifests/1")
            assert status == 200  # the other job's pull is served meanwhile
        finally:
            stalling.stop()


def test_every_accept_line_reaches_the_registry_and_the_tag_list_pages_through_the_mirror(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy
) -> None:
    """containers/image sends one Accept line per media type: the registry picks the manifest's
    format by all of them (an OCI image asked with a manifest list's type first is there), and a
    tag list's next page (its Link header) leads back through the mirror, not around it."""
    import http.client

    with Registry(tmp_path / "registry", users={"robot": PASSWORD}) as registry:
        for tag in ("1", "2", "3"):
            push(image, f"{registry.host}/team/app:{tag}", credentials=("robot", PASSWORD))
        login = Login(registry.host, "robot", PASSWORD, plain_http=True)
        grant, [(_, mirror)] = proxy.grant([login], reaching(registry.host))
        base = f"/v2/{grant}/r0/team/app"
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        connection.putrequest("GET", f"{base}/manifests/1")
        connection.putheader("Accept", "application/vnd.docker.distribution.manifest.list.v2+json")
        connection.putheader("Accept", "application/vnd.oci.image.manifest.v1+json")
        connection.endheaders()
        answer = connection.getresponse()
        assert answer.status == 200, answer.read()
        assert answer.getheader("Content-Type") == "application/vnd.oci.image.manifest.v1+json"

        tags, page = [], f"http://127.0.0.1:{proxy.port}{base}/tags/list?n=1"
        while page:
            with urllib.request.urlopen(page) as listed:
                tags += json.loads(listed.read())["tags"]
                link = listed.headers.get("Link")
            page = f"http://127.0.0.1:{proxy.port}{link.split('>')[0][1:]}" if link else ""
            assert not link or link.startswith(f"<{base}/tags/list?"), link
        assert sorted(tags) == ["1", "2", "3"]  # one page each, every tag once


def test_a_client_that_trickles_its_request_is_cut_and_connections_are_capped(
    proxy: RegistryProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a job that holds the agent's threads: a request head not whole within
    HEAD_SECONDS is cut (a per-read timeout alone lets a byte every 29 s hold it for ever), and
    past MAX_CONNECTIONS a connection is closed at once."""
    import socket

    from catacloud.agent import registry_proxy

    monkeypatch.setattr(registry_proxy, "HEAD_SECONDS", 1.0)
    monkeypatch.setattr(registry_proxy, "MAX_CONNECTIONS", 3)
    port = proxy.port  # the server starts now, with these limits
    trickler = socket.create_connection(("127.0.0.1", port))
    trickler.sendall(b"GET /v2/ HTTP/1.0\r\n")
    started, cut = time.monotonic(), False
    while time.monotonic() - started < 6:
        try:
            trickler.sendall(b"X-A: b\r\n")
        except OSError:
            cut = True
            break
        time.sleep(0.3)
    assert cut and time.monotonic() - started < 4, "the trickling client was not cut"
    trickler.close()

    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", port))
    extra.settimeout(2)
    assert extra.recv(1) == b""  # closed at once: no thread for it
    for s in [*idle, extra]:
        s.close()
    time.sleep(1.5)  # the idle ones were cut (no head): a new client is served again
    assert get(f"http://127.0.0.1:{port}/v2/")[0] == 200


def test_a_job_naming_repository_after_repository_cannot_hammer_the_token_service(
    tmp_path: Path, image: BuiltImage, proxy: RegistryProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from catacloud.agent import registry_proxy

    monkeypatch.setattr(registry_proxy, "TOKEN_BURST", 2)
    monkeypatch.setattr(registry_proxy, "TOKEN_RATE", 0.01)
    with Registry(tmp_path / "registry", users={"robot": PASSWORD}, token=True) as registry:
        assert registry.tokens is not None
        login = Login(registry.host, "robot", PASSWORD, plain_http=True)
        service = f"127.0.0.1:{registry.tokens.port}"
        _, [(_, mirror)] = proxy.grant([login], reaching(registry.host, service))
        asked = len(registry.tokens.scopes)
        answers = [get(f"http://{_url(mirror)}/team/n{i}/manifests/1")[0] for i in range(4)]
        assert answers[:2] == [404, 404] and answers[2:] == [429, 429], answers  # unknown names, then
        assert len(registry.tokens.scopes) - asked == 2
