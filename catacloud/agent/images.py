"""The machine's image store: container images pulled once per machine, unpacked once, reused
read-only by every job that names them.

Pulling and unpacking are done by the tools made for it, never by a tar loop of our own:
``skopeo`` copies an image from its registry into one OCI image layout (every image's blobs in
one place, so a layer two images share is fetched and kept once), ``umoci raw unpack
--rootless`` unpacks it into a root file system (whiteouts, hard links, ``..`` entries and all,
as the OCI image spec says). What the store holds, under its root (the machine's folder, hidden
from jobs)::

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

**Budget.** The store keeps its size (blobs plus unpacked roots) within the machine type's budget:
before a pull it evicts the least recently used images no job is using; an image that alone is
larger than the budget is refused.
"""

from __future__ import annotations

import contextlib
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
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
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
        for sub, mode in (("", 0o711), ("images", 0o711), ("tmp", 0o700), ("private", 0o700)):
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
        return not (
            ref.loopback or ref.registry.lower() in self.insecure or ref.host.lower() in self.insecure
        )

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
