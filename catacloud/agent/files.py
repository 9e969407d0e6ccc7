"""Job outputs and checkpoints: the files that outlive the machine.

Every job gets two private directories next to its working files: ``output`` (every regular file
left there is uploaded, one by one, when the job ends, whatever its outcome) and ``checkpoint``
(uploaded as one gzip'd tar while the job runs: when the job asks with ``catacloud checkpoint``,
every ``interval_seconds`` if it changed, and at once on a spot interruption notice; restored
into the next attempt's directory before its command starts).

This module holds the file-system side: listing outputs, fingerprinting, archiving and safely
extracting checkpoints, and the per-job :class:`Checkpointer` that serializes the saves.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from catacloud.agent.client import AgentAPIError, Gone, Unauthorized, redact
from catacloud.protocol import AgentError

log = logging.getLogger("catacloud.agent")

OUTPUT_ENV = "CATACLOUD_OUTPUT_DIR"
CHECKPOINT_ENV = "CATACLOUD_CHECKPOINT_DIR"
MAX_ARTIFACT_BYTES = 5 * 1024**3


# -- plain file helpers -------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputFile:
    """One file to upload: its artifact name (``/``-separated, relative) and where it is."""

    name: str
    path: str


def list_outputs(root: str) -> list[OutputFile]:
    """The regular files under ``root``, recursively, sorted by name; symbolic links (to files
    or directories) are skipped."""
    found: list[OutputFile] = []
    if not os.path.isdir(root):
        return found
    for dirpath, dirnames, filenames in os.walk(root):  # never follows links to directories
        dirnames.sort()
        for filename in sorted(filenames):
            path = os.path.join(dirpath, filename)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if not stat.S_ISREG(mode):
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            found.append(OutputFile(name=rel, path=path))
    return sorted(found, key=lambda output: output.name)


def display_name(name: str) -> str:
    """A file name fit for JSON and logs (undecodable bytes become U+FFFD)."""
    return os.fsencode(name).decode("utf-8", errors="replace")


def url_quote_name(name: str) -> str:
    """``a dir/b#1.txt`` -> ``a%20dir/b%231.txt``: each ``/``-separated segment quoted alone."""
    return "/".join(quote(segment, safe="") for segment in os.fsencode(name).split(b"/"))


def _entries(root: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path, relative name, lstat) of everything under ``root`` we keep: dirs, files, links."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in dirnames + sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # it vanished meanwhile
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                yield path, os.path.relpath(path, root), st


def fingerprint(root: str) -> str:
    """A cheap digest of names, types, sizes and mtimes under ``root`` (no content is read)."""
    digest = hashlib.sha256()
    for _, rel, st in _entries(root):
        line = f"{stat.S_IFMT(st.st_mode)} {st.st_size} {st.st_mtime_ns} "
        digest.update(line.encode() + os.fsencode(rel) + b"\0")
    return digest.hexdigest()


def open_beneath(root: str, rel: str) -> int:
    """A read-only fd of ``root/rel`` that follows no symbolic link on the way (``OSError``
    otherwise): the job may swap a file or a folder for a link while the agent, which may be
    root, reads its folder."""
    parts = [p for p in rel.split(os.sep) if p not in ("", ".")]
    if not parts or ".." in parts:
        raise OSError(f"not a path inside {root}: {rel!r}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)


def archive_dir(root: str, dest: str) -> None:
    """Write ``root``'s content (relative paths; no devices, fifos or sockets) as a tar.gz.

    Regular files are read through :func:`open_beneath`, so a file swapped for a link between
    the listing and the read is skipped, never followed."""
    with tarfile.open(dest, "w:gz", compresslevel=6) as tar:
        for path, rel, st in _entries(root):
            try:
                if not stat.S_ISREG(st.st_mode):
                    tar.add(path, arcname=rel, recursive=False)  # folders and links: no content read
                    continue
                with os.fdopen(open_beneath(root, rel), "rb") as fh:
                    info = tar.gettarinfo(arcname=rel, fileobj=fh)
                    if not info.isreg():
                        continue
                    tar.addfile(info, fh)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("checkpoint: not archiving %r (%s)", rel, exc)
                continue


def clear_dir(root: str) -> None:
    """Remove everything inside ``root`` (not ``root`` itself)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def extract_archive(archive: str, root: str) -> list[str]:
    """Extract a tar(.gz) into ``root`` with the ``data`` filter; answers the members skipped
    as unsafe (absolute or ``..`` paths, links leading outside, devices)."""
    skipped: list[str] = []

    def safe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        try:
            return tarfile.data_filter(member, dest)
        except tarfile.FilterError as exc:
            skipped.append(member.name)
            log.warning("checkpoint: not restoring %r (%s)", member.name, exc)
            return None

    with tarfile.open(archive, "r:*") as tar:  # gzip'd as agreed; a plain tar would do too
        tar.extractall(root, filter=safe)
    return skipped


# -- checkpoints --------------------------------------------------------------------------------


class CheckpointError(Exception):
    """A checkpoint could not be saved; ``status`` is what the job's command hears."""

    def __init__(self, message: str, *, status: int = 502, code: str = "checkpoint_failed") -> None:
        super().__init__(redact(message))
        self.status = status
        self.code = code


# upload(archive path, interrupt) -> the server's answer ({"size", "sha256"}); raises Gone on 409
Upload = Callable[[str, threading.Event], dict[str, Any]]


class Checkpointer:
    """The checkpoint directory of the running job: saves one at a time, periodically if asked.

    A save is skipped (``only_if_changed``) when the fingerprint of the directory equals the
    one at the last save (or at the restore). Once the server answers 409 the job is no longer
    this machine's and every later save is refused.
    """

    def __init__(
        self,
        job_id: str,
        directory: str,
        upload: Upload,
        *,
        tmp_dir: str,
        interval: float | None = None,
    ) -> None:
        self.job_id = job_id
        self.directory = directory
        self._upload = upload
        self.tmp_dir = tmp_dir
        self.interval = interval
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._saved = fingerprint(directory)
        self.gone = False
        self.saves = 0
        self._thread: threading.Thread | None = None

    def mark_saved(self) -> None:
        """The directory's current content is on the server (just restored)."""
        with self._lock:
            self._saved = fingerprint(self.directory)

    def start(self) -> None:
        if self.interval and self.interval > 0:
            self._thread = threading.Thread(target=self._periodic, name="checkpointer", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """The job ended: stop the periodic saves and refuse new ones."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _periodic(self) -> None:
        assert self.interval
        while not self._closed.wait(self.interval):
            try:
                self.save("periodic", only_if_changed=True)
            except Unauthorized:
                return  # the heartbeat hears it too and stops the agent
            except CheckpointError as exc:
                log.warning("job %s: periodic checkpoint failed: %s", self.job_id, exc)
                if self.gone:
                    return
            except Exception:
                log.exception("job %s: periodic checkpoint failed", self.job_id)

    def save(self, why: str, *, only_if_changed: bool) -> dict[str, Any] | None:
        """Archive and upload the directory; the server's answer, or ``None`` when skipped."""
        with self._lock:
            if self.gone:
                raise CheckpointError(
                    "the job is no longer this machine's", status=409, code=AgentError.JOB_NOT_RUNNING
                )
            if self._closed.is_set():
                raise CheckpointError("the job has ended", status=409, code=AgentError.JOB_NOT_RUNNING)
            print_ = fingerprint(self.directory)
            if only_if_changed and print_ == self._saved:
                log.debug("job %s: checkpoint unchanged; not saving (%s)", self.job_id, why)
                return None
            try:
                fd, archive = tempfile.mkstemp(
                    prefix=".catacloud-checkpoint-", suffix=".tar.gz", dir=self.tmp_dir
                )
                os.close(fd)
            except OSError as exc:
                raise CheckpointError(f"cannot create the archive: {exc}") from exc
            started = time.monotonic()
            try:
                for attempt in range(2):  # a file changing size under tar spoils the archive
                    try:
                        archive_dir(self.directory, archive)
                        break
                    except OSError as exc:
                        if attempt:
                            raise CheckpointError(f"could not archive the checkpoint: {exc}") from exc
                        print_ = fingerprint(self.directory)
                try:
                    answer = self._upload(archive, self._closed)
                except Gone as exc:
                    self.gone = True
                    raise CheckpointError(
                        "the control plane refused it: the job is no longer this machine's",
                        status=409,
                        code=AgentError.JOB_NOT_RUNNING,
                    ) from exc
                except Unauthorized:
                    raise
                except AgentAPIError as exc:
                    raise CheckpointError(f"upload failed: {exc}") from exc
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(archive)
            self._saved = print_
            self.saves += 1
            log.info(
                "job %s: checkpoint saved (%s, %s bytes, %.1f s)",
                self.job_id,
                why,
                answer.get("size"),
                time.monotonic() - started,
            )
            return answer


# -- the job's side: ``catacloud checkpoint`` ---------------------------------------------------


def checkpoint_command(*, environ: Mapping[str, str] | None = None, timeout: float = 3600.0) -> int:
    """``catacloud checkpoint``: ask the agent to save the checkpoint directory now."""
    from catacloud.agent.meta import SOCKET_ENV, TOKEN_ENV, call_agent

    env: Mapping[str, str] = os.environ if environ is None else environ
    socket_path = env.get(SOCKET_ENV, "")
    token = env.get(TOKEN_ENV, "")
    for name, value in ((SOCKET_ENV, socket_path), (TOKEN_ENV, token)):
        if not value:
            print(f"checkpoint: {name} is not set; run this inside a Catacloud job", file=sys.stderr)
            return 1
    try:
        status, body = call_agent(
            "POST", "/v1/checkpoint", socket_path=socket_path, token=token, timeout=timeout
        )
    except OSError as exc:
        print(f"checkpoint: cannot reach the agent at {socket_path}: {exc}", file=sys.stderr)
        return 1
    if status == 200:
        print(f"checkpoint saved: {body.get('size')} bytes, sha256 {body.get('sha256')}")
        return 0
    detail = body.get("detail") or body.get("code") or f"HTTP {status}"
    print(f"checkpoint: {redact(str(detail))}", file=sys.stderr)
    return 1
