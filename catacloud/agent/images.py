"""The machine's image store: container images pulled once per machine, unpacked once, reused
read-only by every job that names them.

Pulling and unpacking are done by the tools made for it, never by a tar loop of our own:
``skopeo`` copies an image from its registry into one OCI image layout (every image's blobs in
one place, so a layer two images share is fetched and kept once), ``umoci raw unpack
--rootless`` unpacks it into a root file system (whiteouts, hard links, ``..`` entries and all,
as the OCI image spec says). What the store holds, under its root (0700, in the machine's folder,
hidden from jobs)::

    oci/              the OCI layout: blobs shared between images, one tag per image (its digest)
    images/<hex>/     one unpacked image: rootfs/ and image.json (its config, references, size)
    tmp/              where an image is unpacked before it is moved into images/ (emptied after)
    private/          0700: the pull's credentials (a 0600 auth file, removed after), skopeo's
                      policy and home
    index.json        which references name which digest, sizes, when each was last used

**Once.** Pulls are serialised on the store (a lock file): a second request for an image being
pulled waits for that pull and then finds it held. A reference with a digest, or with a tag other
than ``latest``, that the store holds is used without asking the registry (Kubernetes' default
pull policy); ``:latest`` is looked up again (one manifest request) and pulled only if it moved.
Every pull names the digest it resolved (``repository@sha256:…``), so a tag that moves mid-pull
changes nothing, and the job records that digest.

**Never half.** skopeo verifies every blob against its digest and writes it under its final name
only then; an image is unpacked into ``tmp/`` and moved into ``images/`` in one rename once it is
complete. A pull that fails, is cancelled or outlives its deadline is killed and leaves nothing:
its temporary files and every blob no held image names are removed.

**Faults.** A registry's 5xx, a refused or cut connection is retried with backoff until the
deadline (blobs already fetched are kept: a retry fetches only what is missing); a missing image,
refused credentials, a digest mismatch or an image larger than the budget end at once with an
:class:`~catacloud.protocol.ImageFailure` code.

**No privilege.** ``umoci raw unpack --rootless`` keeps what a layer says of a file's owner, mode
and extended attributes (it has no option to drop them), so an image's root-owned 4755 file
would be a setuid-root file on the host. Before an image moves into ``images/`` every file and
folder of it loses its set-user-ID and set-group-ID bits and the attributes that grant or steer
privilege (:func:`strip_privileges`, :data:`STRIPPED_XATTRS`); a device node would become an empty
regular file (umoci makes none rootless). A store unpacked by an agent from before is stripped
once when it opens (the agent opens a store it finds when it starts). And no host user reaches
the store: its root is 0700. A job's sandbox does, by the image's path: bubblewrap runs as the
job's uid, so while the sandbox lives (bubblewrap's ``--sync-fd``) that uid alone may pass the
root (a POSIX ACL entry, search only: :func:`let_in`).

**Budget.** The store keeps its size (blobs plus unpacked roots) within the machine type's budget:
before a pull it evicts the least recently used images no job is using; an image that alone is
larger than the budget is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from catacloud.agent.backoff import backoff
from catacloud.agent.reference import ImageRef
from catacloud.protocol import ImageFailure, RegistryAuth

log = logging.getLogger("catacloud.agent")

DEFAULT_BUDGET_BYTES = 10 * 10**9
INSTALL_HINT = "install Debian's skopeo and umoci packages (apt install skopeo umoci)"
# Media types of a list of per-platform manifests (OCI index, Docker manifest list).
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
# Where the sandbox mounts something over the image's root: made (never through a link) once,
# when the image is unpacked, since a job's root is read-only.
MOUNT_DIRS = ("proc", "dev", "tmp", "run", "var/tmp", "etc")
MOUNT_FILES = ("etc/passwd", "etc/group", "etc/resolv.conf")
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm"}


class Cancel(Protocol):
    def is_set(self) -> bool: ...


class ImageError(Exception):
    """An image the job cannot have: ``code`` says why, for the control plane."""

    def __init__(self, code: ImageFailure, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class PullCancelled(Exception):
    """The job was cancelled (or the agent is stopping) while its image was being pulled."""


class _Transient(Exception):
    """A fault worth another try (a registry's 5xx, a refused or cut connection)."""


@dataclass(frozen=True)
class ImageConfig:
    """What the image says about running it (its OCI config's ``config``)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()  # NAME=value
    working_dir: str = ""
    user: str = ""

    @classmethod
    def from_oci(cls, config: dict[str, Any]) -> ImageConfig:
        c = config.get("config") or {}

        def strings(value: Any) -> tuple[str, ...]:
            return tuple(str(v) for v in value) if isinstance(value, list) else ()

        return cls(
            entrypoint=strings(c.get("Entrypoint")),
            cmd=strings(c.get("Cmd")),
            env=strings(c.get("Env")),
            working_dir=str(c.get("WorkingDir") or ""),
            user=str(c.get("User") or ""),
        )

    def env_map(self) -> dict[str, str]:
        pairs = (entry.split("=", 1) for entry in self.env if "=" in entry)
        return {name: value for name, value in pairs if name}

    def to_json(self) -> dict[str, Any]:
        return {
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
            "env": list(self.env),
            "working_dir": self.working_dir,
            "user": self.user,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(
            entrypoint=tuple(data.get("entrypoint", ())),
            cmd=tuple(data.get("cmd", ())),
            env=tuple(data.get("env", ())),
            working_dir=data.get("working_dir", ""),
            user=data.get("user", ""),
        )


@dataclass(frozen=True)
class Image:
    """An image the store holds: its root file system (read-only to jobs) and its config."""

    digest: str
    rootfs: str
    config: ImageConfig
    references: tuple[str, ...] = ()
    bytes: int = 0


@dataclass(frozen=True)
class Pulled:
    """How :meth:`ImageStore.ensure` got the image: ``pulled`` now (``bytes`` fetched) or held."""

    image: Image
    pulled: bool
    bytes: int
    seconds: float


@dataclass
class Tools:
    skopeo: str
    umoci: str


def find_tools() -> Tools | str:
    """skopeo and umoci, or why images cannot run here."""
    skopeo, umoci = shutil.which("skopeo"), shutil.which("umoci")
    missing = [name for name, path in (("skopeo", skopeo), ("umoci", umoci)) if path is None]
    if missing or skopeo is None or umoci is None:
        return f"{' and '.join(missing)} not found: {INSTALL_HINT}"
    return Tools(skopeo=skopeo, umoci=umoci)


def goarch() -> str:
    machine = platform.machine().lower()
    return _GOARCH.get(machine, machine)


def classify(stderr: str) -> ImageError | _Transient:
    """What a failed skopeo call means, from what it printed."""
    text = stderr.lower()
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
    found = re.search(r'msg="(.*)"', last)
    if found:  # skopeo's log line: its message alone, unescaped
        last = found[1].replace('\\"', '"')
        last = re.sub(r'^Error parsing image name "[^"]*": ', "", last)
    last = last[:400]
    if "digest did not match" in text or "digest mismatch" in text or "does not match digest" in text:
        return ImageError(
            ImageFailure.DIGEST_MISMATCH, f"the registry sent content that fails its digest: {last}"
        )
    if any(
        s in text for s in ("unauthorized", "authentication required", "denied", "status 401", "status 403")
    ):
        return ImageError(ImageFailure.AUTH_FAILED, f"the registry refused the credentials: {last}")
    if any(
        s in text for s in ("manifest unknown", "name unknown", "not found", "status 404", "no such host")
    ):
        return ImageError(ImageFailure.NOT_FOUND, f"no such image: {last}")
    return _Transient(last)


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (a hard-linked file counted once)."""
    total, seen = 0, set()
    stack = [path]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            elif stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _rmtree(path: str) -> None:
    """Remove ``path`` whatever the image's modes (a 0555 folder of an image, unpacked rootless)."""

    def retry(func: Any, target: str, exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(target)

    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    elif os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)


def _open_dir(parent: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)


def _make_path(root: int, relative: str, *, file: bool = False) -> None:
    """Make ``relative`` under the folder ``root`` (a descriptor) a folder (or an empty regular
    file), never following a link: a link or other entry in the way is replaced (the image's
    copy is ours; a job's root is read-only, so whatever the sandbox mounts on must exist)."""
    parts = [p for p in relative.split("/") if p and p != "."]
    if ".." in parts:
        raise ValueError(f"{relative!r}: no '..'")
    fd = os.dup(root)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            want_file = file and last
            if st is not None and (stat.S_ISREG(st.st_mode) if want_file else stat.S_ISDIR(st.st_mode)):
                pass
            else:
                if st is not None:
                    if stat.S_ISDIR(st.st_mode):
                        child = _open_dir(fd, part)
                        os.close(child)
                        _rmtree(f"/proc/self/fd/{fd}/{part}")
                    else:
                        os.unlink(part, dir_fd=fd)
                if want_file:
                    os.close(
                        os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
                    )
                else:
                    os.mkdir(part, 0o755, dir_fd=fd)
            if not last:
                child = _open_dir(fd, part)
                os.close(fd)
                fd = child
    finally:
        os.close(fd)


# -- what an image may not bring: privilege ------------------------------------------------------

# Mode bits no file of the store keeps: set-user-ID and set-group-ID (``umoci raw unpack
# --rootless`` keeps them, on files it leaves owned by the agent: root on a cloud machine).
SETID_BITS = stat.S_ISUID | stat.S_ISGID
# Extended attributes no file of the store keeps, each a privilege or a host's kernel's own:
# file capabilities (``security.capability``: what a process gains when it executes the file),
# Smack's rules for what runs or maps a file (``security.SMACK64EXEC``, ``…MMAP``,
# ``…TRANSMUTE``), and every ``trusted.*`` attribute (root's own namespace, read by the kernel:
# overlayfs' redirects and the like). Kept: ``user.*`` (umoci's record of an owner), POSIX ACLs
# (``system.*``: who may read a file, no privilege), and the security labels a host's LSM and
# integrity modules give every file they see (``security.selinux``, which umoci never sets from an
# image; ``security.SMACK64``; IMA/EVM's ``security.ima``/``security.evm``, which only the host's
# keys can make valid): removing those would make the host's policy refuse the image.
STRIPPED_XATTRS = (
    "security.capability",
    "security.SMACK64EXEC",
    "security.SMACK64MMAP",
    "security.SMACK64TRANSMUTE",
)
STRIPPED_XATTR_PREFIXES = ("trusted.",)
# What the index records of an image whose files were stripped (a store from before is stripped
# once, when it opens).
STRIP_VERSION = 1


@dataclass
class Stripped:
    """What :func:`strip_privileges` took away, counted."""

    setid: int = 0  # files and folders that lost set-user-ID or set-group-ID
    xattrs: int = 0  # attributes removed
    devices: int = 0  # device nodes made empty regular files

    def __bool__(self) -> bool:
        return bool(self.setid or self.xattrs or self.devices)


def _stripped_xattr(name: str) -> bool:
    return name in STRIPPED_XATTRS or name.startswith(STRIPPED_XATTR_PREFIXES)


def _strip_entry(parent: int, name: str, st: os.stat_result, found: Stripped) -> None:
    """One file or folder (never a link: the caller skips those) of a tree no one else sees."""
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):  # (umoci makes none rootless)
        os.unlink(name, dir_fd=parent)
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=parent))
        found.devices += 1
        return
    # Through the folder's descriptor, never a path from the top: nothing on the way is followed.
    here = f"/proc/self/fd/{parent}/{name}"
    try:
        names = os.listxattr(here, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        names = []
    for attribute in names:
        if _stripped_xattr(attribute):
            os.removexattr(here, attribute, follow_symlinks=False)
            found.xattrs += 1
    if st.st_mode & SETID_BITS:
        os.chmod(name, stat.S_IMODE(st.st_mode) & ~SETID_BITS, dir_fd=parent, follow_symlinks=False)
        found.setid += 1


def _open_listing(parent: int, name: str, st: os.stat_result) -> tuple[int, list[str], int | None]:
    """A folder's descriptor and names. A folder of the agent's own that it may not read or pass
    (an agent that is not root, an image's 0000 folder) is opened to its owner for the walk; its
    mode, to put back after, comes third."""
    mode = None
    if os.geteuid() != 0 and st.st_uid == os.geteuid() and st.st_mode & 0o500 != 0o500:
        mode = stat.S_IMODE(st.st_mode) & ~SETID_BITS
        os.chmod(name, mode | stat.S_IRWXU, dir_fd=parent, follow_symlinks=False)
    fd = _open_dir(parent, name)
    try:
        return fd, os.listdir(fd), mode
    except BaseException:
        os.close(fd)
        raise


def strip_privileges(rootfs: str) -> Stripped:
    """Take from every file and folder under ``rootfs`` (itself included) what would give a
    privilege to whoever runs it: set-user-ID and set-group-ID bits and the attributes of
    :data:`STRIPPED_XATTRS`; a device node becomes an empty regular file. Links are never
    followed (nor changed: Linux has no mode for a link, and attaches no capability to one).

    The walk goes folder by folder through descriptors opened with ``O_NOFOLLOW``, and acts on
    each entry relative to its folder's descriptor: a path is never resolved from the top. It
    runs on an image no one else can reach (unpacked in the store's private ``tmp/``, before it
    moves into ``images/``; or, for a store from before, under the store's lock with the store's
    root closed), so nothing changes under it."""
    found = Stripped()
    parent, top = os.path.split(os.path.abspath(rootfs))
    start = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    # (descriptor, names left, (folder to put a mode back on: its parent's descriptor, name, mode))
    stack: list[tuple[int, list[str], tuple[int, str, int] | None]] = [(start, [top], None)]
    try:
        while stack:
            fd, names, restore = stack[-1]
            if not names:
                stack.pop()
                if restore is not None:
                    os.chmod(restore[1], restore[2], dir_fd=restore[0], follow_symlinks=False)
                os.close(fd)
                continue
            name = names.pop()
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                continue
            _strip_entry(fd, name, st, found)
            if stat.S_ISDIR(st.st_mode):
                child, entries, mode = _open_listing(fd, name, st)
                stack.append((child, entries, None if mode is None else (fd, name, mode)))
    finally:
        for fd, _names, _restore in stack:
            os.close(fd)
    return found


# -- the store's door: its root is 0700; a job's sandbox is let through while it lives -----------

# A POSIX access ACL as the kernel keeps it (``system.posix_acl_access``: version 2, then entries
# of tag, permissions, id sorted by tag and id; acl(5), linux/posix_acl_xattr.h).
ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_NO_ID = 0xFFFFFFFF
_doors_lock = threading.Lock()
_doors: dict[str, Counter[int]] = {}  # a store's root -> the job uids let through, and how often
_no_acl: set[str] = set()  # roots on a file system without ACLs (0711 instead: see ImageStore)


def search_acl(uids: Iterable[int]) -> bytes:
    """An access ACL for a folder: its owner everything, each of ``uids`` search only (``--x``:
    pass through, never list), its group and everyone else nothing."""
    entries = [(_ACL_USER_OBJ, 0o7, _ACL_NO_ID)]
    entries += [(_ACL_USER, 0o1, uid) for uid in sorted(set(uids))]
    entries += [(_ACL_GROUP_OBJ, 0, _ACL_NO_ID), (_ACL_MASK, 0o1, _ACL_NO_ID), (_ACL_OTHER, 0, _ACL_NO_ID)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def _set_door(root: str, uids: Iterable[int]) -> None:
    """``root`` passable by ``uids`` alone (besides its owner); none: plain 0700 again."""
    wanted = sorted(set(uids))
    if wanted:
        os.setxattr(root, ACL_XATTR, search_acl(wanted), follow_symlinks=False)
        return
    # 0700 first: with the ACL still there this sets its mask to nothing, so the door is shut
    # before the ACL goes (and the mask would otherwise stay as the group's bits once removed).
    os.chmod(root, 0o700)
    with contextlib.suppress(OSError):
        os.removexattr(root, ACL_XATTR, follow_symlinks=False)


def _store_root(rootfs: str) -> str | None:
    """The store whose image ``rootfs`` is (``<root>/images/<hex>/rootfs``), if this process opened it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(rootfs))))
    with _doors_lock:
        return root if root in _doors else None


def let_in(rootfs: str, uid: int) -> Callable[[], None] | None:
    """Let ``uid`` pass the root of the store holding ``rootfs`` (search only: it still lists
    nothing, reads nothing of the store but the image's root, whose path it is told), until the
    returned function is called. For a job's sandbox: bubblewrap runs as the job's uid and
    resolves the image's root by its path (even a descriptor it is given, through
    ``/proc/self/fd``), so a 0700 root would refuse it. ``None``: nothing to do (not a store's
    image, the agent's own uid, or a file system without ACLs, whose store root is 0711)."""
    root = _store_root(rootfs)
    if root is None or uid == os.geteuid() or root in _no_acl:
        return None
    with _doors_lock:
        grants = _doors[root]
        grants[uid] += 1
        _set_door(root, grants)
    done = threading.Event()

    def close() -> None:
        with _doors_lock:
            if done.is_set():
                return
            done.set()
            grants[uid] -= 1
            if grants[uid] <= 0:
                del grants[uid]
            try:
                _set_door(root, grants)
            except OSError as exc:  # (the store's folder gone with its machine)
                log.warning("image store %s: could not close it to uid %s: %s", root, uid, exc)

    return close


def _open_store_root(root: str) -> str:
    """Make ``root`` 0700 with no one let in (a door left open by an agent that died is shut),
    unless this process's jobs are in it now; register it for :func:`let_in`. Where the file
    system keeps no ACLs the root is 0711 instead (passable, not listable): what the machine
    reports says so."""
    with _doors_lock:
        grants = _doors.setdefault(root, Counter())
        if grants:
            return ""
        try:
            _set_door(root, [os.geteuid()])  # can this file system hold an ACL at all?
            _set_door(root, [])
            _no_acl.discard(root)
            return ""
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EINVAL):
                raise
            _no_acl.add(root)
            os.chmod(root, 0o711)
            return (
                f"its file system keeps no ACLs ({exc.strerror}): the store's root is 0711, so a job's "
                "sandbox can pass it (its folders cannot be listed; its files carry no privilege)"
            )


def resolve_inside(rootfs: str, path: str, hops: int = 40) -> str | None:
    """Where ``path`` of the image leads, resolved as if ``rootfs`` were ``/`` (its links,
    absolute or relative, never leave it); ``None`` when it leads nowhere."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(rootfs, *done, part)
        try:
            st = os.lstat(here)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        done.append(part)
    return os.path.join(rootfs, *done)


class ImageStore:
    """One machine's images (the module docstring says how)."""

    def __init__(
        self,
        root: str,
        *,
        tools: Tools,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        mount_dirs: Sequence[str] = (),
        insecure_registries: Sequence[str] = (),
        retry_base: float = 0.5,
        retry_cap: float = 10.0,
    ) -> None:
        self.root = os.path.abspath(root)
        self.tools = tools
        self.budget_bytes = budget_bytes
        # Folders of the machine a job sees inside an image too (its work root, shared folders).
        self.mount_dirs = tuple(mount_dirs)
        self.insecure = {h.lower() for h in insecure_registries}
        self.retry_base, self.retry_cap = retry_base, retry_cap
        self._pinned: Counter[str] = Counter()
        self._pin_lock = threading.Lock()
        # The root is 0700: only the agent, and a job's sandbox while it lives (let_in), pass it.
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.note = _open_store_root(self.root)  # why the root is not 0700, if it is not
        if self.note:
            log.warning("image store %s: %s", self.root, self.note)
        for sub, mode in (("images", 0o711), ("tmp", 0o700), ("private", 0o700)):
            path = os.path.join(self.root, sub)
            os.makedirs(path, exist_ok=True)
            os.chmod(path, mode)
        self.oci = os.path.join(self.root, "oci")
        policy = os.path.join(self.root, "private", "policy.json")
        if not os.path.exists(policy):  # signatures are not checked: the digest pins the content
            with open(policy, "w") as fh:
                json.dump({"default": [{"type": "insecureAcceptAnything"}]}, fh)
        os.makedirs(os.path.join(self.root, "private", "home"), exist_ok=True)
        self._env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.path.join(self.root, "private", "home"),
            "TMPDIR": os.path.join(self.root, "tmp"),
            "LANG": "C.UTF-8",
        }
        self._strip_held()

    def _strip_held(self) -> None:
        """A store unpacked before images were stripped (an agent upgraded on its machine): each
        image the index does not record as stripped is, once, under the store's lock; then the
        index says so, and the next opening reads the index alone. A folder the index does not
        name (an unpack that died before it was recorded) is removed: no job can use it."""
        try:
            folders = sorted(e.name for e in os.scandir(os.path.join(self.root, "images")))
        except OSError:
            return
        held = self._index()["images"]
        if all(held.get(f"sha256:{name}", {}).get("stripped", 0) >= STRIP_VERSION for name in folders):
            return
        with self._locked(time.monotonic() + 3600, threading.Event()):
            index = self._index()
            for name in folders:
                entry = index["images"].get(f"sha256:{name}")
                if entry is None or os.path.islink(os.path.join(self.root, "images", name)):
                    _rmtree(os.path.join(self.root, "images", name))
                    index["images"].pop(f"sha256:{name}", None)
                    continue
                if entry.get("stripped", 0) >= STRIP_VERSION:
                    continue
                rootfs = os.path.join(self.root, "images", name, "rootfs")
                if os.path.isdir(rootfs) and not os.path.islink(rootfs):
                    found = strip_privileges(rootfs)
                    (log.warning if found else log.info)("image store: %s, held from before: %s", name, found)
                entry["stripped"] = STRIP_VERSION
            self._save(index)

    # -- what it holds -------------------------------------------------------------------------

    def _index(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.root, "index.json")) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = {}
        data.setdefault("images", {})
        data.setdefault("tags", {})
        return data

    def _save(self, index: dict[str, Any]) -> None:
        path = os.path.join(self.root, "index.json")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(index, fh)
        os.replace(path + ".tmp", path)

    def _folder(self, digest: str) -> str:
        return os.path.join(self.root, "images", digest.split(":", 1)[1])

    def image(self, digest: str) -> Image | None:
        entry = self._index()["images"].get(digest)
        folder = self._folder(digest)
        if entry is None or not os.path.isdir(os.path.join(folder, "rootfs")):
            return None
        return Image(
            digest=digest,
            rootfs=os.path.join(folder, "rootfs"),
            config=ImageConfig.from_json(entry.get("config", {})),
            references=tuple(entry.get("references", ())),
            bytes=int(entry.get("bytes", 0)),
        )

    def held(self) -> list[Image]:
        return [img for d in self._index()["images"] if (img := self.image(d)) is not None]

    def registries(self) -> set[str]:
        """The registries (``host[:port]``) of the images the store holds."""
        return {
            ref.split("/", 1)[0]
            for entry in self._index()["images"].values()
            for ref in entry.get("references", ())
        }

    def blob_for(self, repository: str, digest: str) -> str | None:
        """The path of blob ``digest`` when the store holds an image of ``repository``
        (``registry/name``, as a reference names it) whose manifest names that blob (its config or
        a layer): what a job's engine may take from here instead of the registry
        (catacloud/agent/registry_proxy.py). Its bytes were checked against the digest when
        skopeo wrote them; a blob of another repository is not given out."""
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            return None
        for held, entry in self._index()["images"].items():
            if not any(str(r).rpartition("@")[0] == repository for r in entry.get("references", ())):
                continue
            layout = self._manifest_digest(held.split(":", 1)[1])
            try:
                manifest = self._blob(layout) if layout else {}
            except (OSError, ValueError):
                continue
            named = [
                manifest.get("config", {}).get("digest"),
                *(x.get("digest") for x in manifest.get("layers", [])),
            ]
            if digest in named:
                path = os.path.join(self.oci, "blobs", "sha256", digest.split(":", 1)[1])
                return path if os.path.isfile(path) else None
        return None

    def size(self) -> int:
        """Bytes the store uses: every blob once, every unpacked root."""
        blobs = _tree_bytes(os.path.join(self.oci, "blobs")) if os.path.isdir(self.oci) else 0
        return blobs + sum(int(e.get("rootfs_bytes", 0)) for e in self._index()["images"].values())

    @contextlib.contextmanager
    def pinned(self, digest: str) -> Iterator[None]:
        """While a job uses the image, no eviction removes it."""
        with self._pin_lock:
            self._pinned[digest] += 1
        try:
            yield
        finally:
            with self._pin_lock:
                self._pinned[digest] -= 1
                if self._pinned[digest] <= 0:
                    del self._pinned[digest]

    # -- getting one -------------------------------------------------------------------------

    def ensure(self, ref: ImageRef, *, auth: RegistryAuth | None, deadline: float, cancel: Cancel) -> Pulled:
        """The image ``ref`` names, from the store or pulled now (before ``deadline``, on the
        monotonic clock). Raises :class:`ImageError` (the job cannot have it) or
        :class:`PullCancelled`."""
        started = time.monotonic()
        with self._locked(deadline, cancel):
            index = self._index()
            digest = ref.digest or (None if ref.moving else index["tags"].get(str(ref)))
            if digest is not None and self.image(digest) is not None:
                return Pulled(self._use(ref, digest), False, 0, time.monotonic() - started)
            authfile = self._authfile(ref, auth)
            try:
                digest, manifest = self._resolve(ref, authfile, deadline, cancel)
                if self.image(digest) is not None:
                    return Pulled(self._use(ref, digest), False, 0, time.monotonic() - started)
                fetched = self._pull(ref, digest, manifest, authfile, deadline, cancel)
            finally:
                if authfile:
                    with contextlib.suppress(OSError):
                        os.unlink(authfile)
            return Pulled(self._use(ref, digest), True, fetched, time.monotonic() - started)

    def _use(self, ref: ImageRef, digest: str) -> Image:
        index = self._index()
        entry = index["images"][digest]
        refs = {str(ref), str(ref.pinned(digest))}
        entry["references"] = sorted({*entry.get("references", []), *refs})
        entry["used_at"] = time.time()
        if ref.tag:
            index["tags"][str(ImageRef(ref.registry, ref.repository, ref.tag))] = digest
        self._save(index)
        image = self.image(digest)
        assert image is not None
        return image

    @contextlib.contextmanager
    def _locked(self, deadline: float, cancel: Cancel) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self._check(deadline, cancel, "waiting for another pull of this machine")
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    def _check(self, deadline: float, cancel: Cancel, doing: str) -> None:
        if cancel.is_set():
            raise PullCancelled(doing)
        if time.monotonic() > deadline:
            raise ImageError(ImageFailure.PULL_TIMEOUT, f"the pull outlived its deadline ({doing})")

    def _authfile(self, ref: ImageRef, auth: RegistryAuth | None) -> str | None:
        """The credentials in a 0600 file of the agent's own (never in a command line)."""
        if auth is None:
            return None
        import base64

        token = base64.b64encode(f"{auth.username}:{auth.password}".encode()).decode()
        folder = os.path.join(self.root, "private")
        path = os.path.join(folder, f"auth-{os.getpid()}-{threading.get_ident()}.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"auths": {ref.registry: {"auth": token}}}, fh)
        return path

    def _tls(self, ref: ImageRef) -> bool:
        return not ref.plain_http(self.insecure)

    def _skopeo(
        self, args: list[str], *, deadline: float, cancel: Cancel, doing: str, attempts: int = 6
    ) -> str:
        """Run skopeo, retrying transient faults with backoff until ``deadline``; its stdout."""
        argv = [self.tools.skopeo, "--policy", os.path.join(self.root, "private", "policy.json"), *args]
        for attempt in range(attempts):
            code, out, err = self._run(argv, deadline=deadline, cancel=cancel, doing=doing)
            if code == 0:
                return out
            problem = classify(err)
            if isinstance(problem, ImageError):
                raise problem
            self._drop_partial()
            delay = backoff(attempt, base=self.retry_base, cap=self.retry_cap, jitter=(0.75, 1.0))
            if attempt + 1 >= attempts:
                raise ImageError(ImageFailure.PULL_FAILED, f"{doing}: {problem} (after {attempts} tries)")
            if time.monotonic() + delay > deadline:
                raise ImageError(ImageFailure.PULL_TIMEOUT, f"{doing}: {problem}; the deadline came first")
            log.warning("%s: %s; retrying in %.1f s", doing, problem, delay)
            end = time.monotonic() + delay
            while time.monotonic() < end:
                self._check(deadline, cancel, doing)
                time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        raise AssertionError("unreachable")

    def _run(self, argv: list[str], *, deadline: float, cancel: Cancel, doing: str) -> tuple[int, str, str]:
        """One tool call, killed (its whole group) on cancel or past ``deadline``."""
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env,
            cwd=self.root,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=0.05)
                    return proc.returncode, out, err
                except subprocess.TimeoutExpired:
                    self._check(deadline, cancel, doing)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise

    def _resolve(
        self, ref: ImageRef, authfile: str | None, deadline: float, cancel: Cancel
    ) -> tuple[str, dict[str, Any]]:
        """The digest ``ref`` names now (this machine's platform's, for a multi-platform image)
        and its manifest."""
        # (name:tag@digest is the digest: registries' tools take one or the other)
        raw = self._inspect(ref.pinned(ref.digest) if ref.digest else ref, authfile, deadline, cancel)
        manifest = json.loads(raw)
        digest = "sha256:" + hashlib.sha256(raw.encode()).hexdigest()
        if ref.digest is not None and digest != ref.digest and manifest.get("mediaType") not in INDEX_TYPES:
            raise ImageError(ImageFailure.DIGEST_MISMATCH, f"{ref}: the registry sent a manifest of {digest}")
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            arch = goarch()
            choices = [
                m
                for m in manifest.get("manifests", [])
                if (m.get("platform") or {}).get("os") == "linux"
                and (m.get("platform") or {}).get("architecture") == arch
            ]
            if not choices:
                raise ImageError(ImageFailure.NOT_FOUND, f"{ref} has no image for linux/{arch}")
            digest = str(choices[0]["digest"])
            raw = self._inspect(ref.pinned(digest), authfile, deadline, cancel)
            manifest = json.loads(raw)
            if "sha256:" + hashlib.sha256(raw.encode()).hexdigest() != digest:
                raise ImageError(
                    ImageFailure.DIGEST_MISMATCH, f"{ref}: the platform manifest fails its digest"
                )
        return digest, manifest

    def _inspect(self, ref: ImageRef, authfile: str | None, deadline: float, cancel: Cancel) -> str:
        args = ["inspect", "--raw", "--retry-times", "1", f"--tls-verify={str(self._tls(ref)).lower()}"]
        if authfile:
            args += ["--authfile", authfile]
        return self._skopeo(
            [*args, f"docker://{ref}"], deadline=deadline, cancel=cancel, doing=f"looking up {ref}"
        )

    def _pull(
        self,
        ref: ImageRef,
        digest: str,
        manifest: dict[str, Any],
        authfile: str | None,
        deadline: float,
        cancel: Cancel,
    ) -> int:
        """Copy ``digest`` into the layout, unpack it, make it the store's; bytes fetched."""
        compressed = int((manifest.get("config") or {}).get("size", 0)) + sum(
            int(layer.get("size", 0)) for layer in manifest.get("layers", [])
        )
        if compressed > self.budget_bytes:
            raise ImageError(
                ImageFailure.TOO_LARGE,
                f"{ref} is {compressed / 1e6:.1f} MB compressed, more than this machine's image store "
                f"budget of {self.budget_bytes / 1e6:.1f} MB (the machine type's image_cache_mb)",
            )
        self._evict(need=compressed, keep=())  # its layers; the rest is made room for once unpacked
        hexdigest = digest.split(":", 1)[1]
        before = self._blobs()
        try:
            args = [
                "copy",
                "--quiet",
                "--retry-times",
                "2",
                f"--src-tls-verify={str(self._tls(ref)).lower()}",
            ]
            if authfile:
                args += ["--src-authfile", authfile]
            self._skopeo(
                [*args, f"docker://{ref.pinned(digest)}", f"oci:{self.oci}:{hexdigest}"],
                deadline=deadline,
                cancel=cancel,
                doing=f"pulling {ref}",
            )
            fetched = sum(size for blob, size in self._blobs().items() if blob not in before)
            self._unpack(ref, digest, deadline, cancel)
        except BaseException:
            self._forget(digest)
            raise
        self._evict(need=0, keep=(digest,))
        return fetched

    def _unpack(self, ref: ImageRef, digest: str, deadline: float, cancel: Cancel) -> None:
        hexdigest = digest.split(":", 1)[1]
        staging = os.path.join(self.root, "tmp", f"{hexdigest}-{os.getpid()}")
        _rmtree(staging)
        os.mkdir(staging, 0o711)
        try:
            code, _out, err = self._run(
                [
                    self.tools.umoci,
                    "raw",
                    "unpack",
                    "--rootless",
                    "--image",
                    f"{self.oci}:{hexdigest}",
                    os.path.join(staging, "rootfs"),
                ],
                deadline=deadline,
                cancel=cancel,
                doing=f"unpacking {ref}",
            )
            if code != 0:
                raise ImageError(ImageFailure.UNUSABLE, f"could not unpack {ref}: {err.strip()[-400:]}")
            config = self._config(hexdigest)
            rootfs = os.path.join(staging, "rootfs")
            self._prepare(rootfs, config)
            # Before it moves where jobs find it: no file keeps a privilege (setuid, capabilities).
            try:
                found = strip_privileges(rootfs)
            except OSError as exc:  # (a tree deeper than this process may hold folders open)
                raise ImageError(
                    ImageFailure.UNUSABLE, f"could not strip {ref} of its files' privileges: {exc}"
                ) from None
            if found:
                log.warning("image %s: stripped of privileges its files carried: %s", ref, found)
            rootfs_bytes = _tree_bytes(rootfs)
            footprint = rootfs_bytes + self._image_blob_bytes(hexdigest)
            if footprint > self.budget_bytes:
                raise ImageError(
                    ImageFailure.TOO_LARGE,
                    f"{ref} takes {footprint / 1e6:.1f} MB unpacked, more than this machine's image store "
                    f"budget of {self.budget_bytes / 1e6:.1f} MB (the machine type's image_cache_mb)",
                )
            folder = self._folder(digest)
            _rmtree(folder)
            os.replace(staging, folder)
        finally:
            _rmtree(staging)
        index = self._index()
        index["images"][digest] = {
            "references": [],
            "config": config.to_json(),
            "rootfs_bytes": rootfs_bytes,
            "bytes": footprint,
            "used_at": time.time(),
            "stripped": STRIP_VERSION,
        }
        self._save(index)

    def _prepare(self, rootfs: str, config: ImageConfig) -> None:
        """What a job's sandbox mounts on must exist in the (read-only) root; and /bin/sh must,
        which reads the job's env."""
        fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.chmod(fd, 0o755)
            for folder in (*MOUNT_DIRS, *self.mount_dirs, config.working_dir or "/"):
                _make_path(fd, folder)
            for name in MOUNT_FILES:
                _make_path(fd, name, file=True)
        finally:
            os.close(fd)
        shell = resolve_inside(rootfs, "/bin/sh")
        if shell is None or not os.path.isfile(shell):
            raise ImageError(
                ImageFailure.UNUSABLE,
                "the image has no /bin/sh (Catacloud starts every job with it, to apply the job's env)",
            )

    # -- the OCI layout ------------------------------------------------------------------------

    def _blob(self, digest: str) -> dict[str, Any]:
        with open(os.path.join(self.oci, "blobs", *digest.split(":", 1))) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}

    def _manifest_digest(self, tag: str) -> str | None:
        try:
            with open(os.path.join(self.oci, "index.json")) as fh:
                index = json.load(fh)
        except (OSError, ValueError):
            return None
        for entry in index.get("manifests", []):
            if (entry.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag:
                return str(entry["digest"])
        return None

    def _config(self, tag: str) -> ImageConfig:
        manifest_digest = self._manifest_digest(tag)
        if manifest_digest is None:
            raise ImageError(ImageFailure.UNUSABLE, "the pulled image is missing from the store's layout")
        manifest = self._blob(manifest_digest)
        return ImageConfig.from_oci(self._blob(str(manifest["config"]["digest"])))

    def _image_blob_bytes(self, tag: str) -> int:
        manifest_digest = self._manifest_digest(tag)
        if manifest_digest is None:
            return 0
        manifest = self._blob(manifest_digest)
        digests = [
            manifest_digest,
            manifest["config"]["digest"],
            *(layer["digest"] for layer in manifest.get("layers", [])),
        ]
        blobs = self._blobs()
        return sum(blobs.get(str(d).split(":", 1)[-1], 0) for d in digests)

    def _blobs(self) -> dict[str, int]:
        folder = os.path.join(self.oci, "blobs", "sha256")
        try:
            return {e.name: e.stat().st_size for e in os.scandir(folder) if len(e.name) == 64}
        except OSError:
            return {}

    def _drop_partial(self) -> None:
        """Whatever an interrupted copy left half-written (skopeo's temporary files)."""
        for folder in (self.oci, os.path.join(self.oci, "blobs", "sha256"), os.path.join(self.root, "tmp")):
            with contextlib.suppress(OSError):
                for entry in os.scandir(folder):
                    if entry.name.startswith(("oci-put-blob", "oci-dest-", ".tmp")) or (
                        folder.endswith("sha256") and len(entry.name) != 64
                    ):
                        _rmtree(entry.path)

    def _forget(self, digest: str) -> None:
        """Remove an image (its root, its tag) and every blob no other image names."""
        hexdigest = digest.split(":", 1)[1]
        _rmtree(self._folder(digest))
        index = self._index()
        index["images"].pop(digest, None)
        index["tags"] = {ref: d for ref, d in index["tags"].items() if d != digest}
        self._save(index)
        self._drop_partial()
        if os.path.exists(os.path.join(self.oci, "index.json")):
            never = threading.Event()
            far = time.monotonic() + 600
            if self._manifest_digest(hexdigest) is not None:
                self._run(
                    [self.tools.umoci, "rm", "--image", f"{self.oci}:{hexdigest}"],
                    deadline=far,
                    cancel=never,
                    doing="removing an image",
                )
            self._run(
                [self.tools.umoci, "gc", "--layout", self.oci],
                deadline=far,
                cancel=never,
                doing="removing unused layers",
            )

    def _evict(self, *, need: int, keep: Sequence[str]) -> None:
        """Least recently used images no job uses go until ``need`` more bytes fit the budget."""
        index = self._index()
        with self._pin_lock:
            busy = set(self._pinned)
        candidates = sorted(
            (e.get("used_at", 0.0), d) for d, e in index["images"].items() if d not in busy and d not in keep
        )
        for _used, digest in candidates:
            if self.size() + need <= self.budget_bytes:
                return
            log.info("image store: evicting %s (least recently used) to stay within its budget", digest)
            self._forget(digest)
