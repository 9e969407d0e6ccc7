"""The agent's side of images: the machine's store (or why it has none), a pool member's images
pulled before it is ready, a job's image had before its command, and how that command runs
inside it.

How a job's process is made from its image and its ``command``, as ``docker run IMAGE`` and
``docker run IMAGE sh -c COMMAND`` make it (the OCI image config's rules):

- no ``command``: the image's ``Entrypoint`` followed by its ``Cmd``;
- a ``command``: the image's ``Entrypoint`` followed by ``/bin/sh -c COMMAND`` (the command
  replaces ``Cmd``; an image without ``Entrypoint`` simply runs the command with its shell);
- the environment: Catacloud's base (``HOME``, ``TMPDIR`` and ``USER`` as for every job), then
  the image's ``Env`` (its ``PATH`` included), then the job's ``env`` and secret env, then
  ``CATACLOUD_*``;
- the job starts in the image's ``WorkingDir``, or in its work folder when the image names none;
- the image's ``User`` is not taken: a job runs as its own uid, never root, as every job does.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Sequence

from catacloud.agent.client import register_secret
from catacloud.agent.images import (
    DEFAULT_BUDGET_BYTES,
    Cancel,
    Image,
    ImageError,
    ImageStore,
    PullCancelled,
    Pulled,
    find_tools,
)
from catacloud.agent.reference import parse
from catacloud.protocol import HeldImage, ImageFailure, ImagePull, ImagePulled, JobPayload

log = logging.getLogger("catacloud.agent")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Why a machine whose jobs run without bubblewrap (the uid-only fallback) runs no image: an image's
# root is the sandbox's read-only ``/``, and only the sandbox passes the store's 0700 root.
NEEDS_SANDBOX = (
    "its jobs run without the bubblewrap sandbox (uid-only fallback), and an image runs only as a "
    "sandbox's read-only root (the image store is closed to every other uid)"
)


def image_process(image: Image, command: str) -> tuple[str, ...]:
    """The process a job runs inside ``image`` (the module docstring's rules)."""
    config = image.config
    args = (
        (*config.entrypoint, "/bin/sh", "-c", command)
        if command.strip()
        else (*config.entrypoint, *config.cmd)
    )
    if not args:
        raise ImageError(
            ImageFailure.UNUSABLE, "the image names no Entrypoint or Cmd and the job gives no command"
        )
    return args


def image_cwd(image: Image, work_dir: str) -> str:
    return image.config.working_dir or work_dir


class JobImages:
    """One agent's images (the module docstring says how they are used)."""

    def __init__(
        self, root: str | None, *, mount_dirs: Sequence[str], insecure_registries: Sequence[str] = ()
    ) -> None:
        tools = find_tools()
        self.problem = tools if isinstance(tools, str) else None
        self._tools = None if isinstance(tools, str) else tools
        # Made at the first image (an agent that never runs one leaves no folder behind).
        self.root = (
            None
            if self._tools is None
            else root or os.path.join(tempfile.gettempdir(), f"catacloud-images-{secrets.token_hex(6)}")
        )
        self._mount_dirs, self._insecure = tuple(mount_dirs), tuple(insecure_registries)
        self._budget = DEFAULT_BUDGET_BYTES
        self._store: ImageStore | None = None
        self._lock = threading.Lock()
        if self.root is not None and os.path.isdir(self.root):
            # A store this machine already has is opened now, not at the next image: one an older
            # agent filled is stripped of privileges and closed (0700) before anything else runs.
            try:
                _ = self.store
            except OSError as exc:
                log.warning("could not open the image store %s: %s", self.root, exc)

    @property
    def opened(self) -> bool:
        """The machine has a store already (it held an image once): :attr:`store` makes none."""
        return self.root is not None and os.path.isdir(self.root)

    @property
    def store(self) -> ImageStore | None:
        if self._tools is None or self.root is None:
            return None
        with self._lock:
            if self._store is None:
                self._store = ImageStore(
                    self.root,
                    tools=self._tools,
                    budget_bytes=self._budget,
                    mount_dirs=self._mount_dirs,
                    insecure_registries=self._insecure,
                )
            return self._store

    def describe(self, *, sandboxed: bool = True) -> dict[str, str]:
        """What the machine reports at enrollment (Isolation.images). ``sandboxed``: whether its
        jobs run in the bubblewrap sandbox; without it (the uid-only fallback) it runs no image,
        so the control plane sends it none."""
        if self._tools is None:
            return {"images": "", "images_detail": f"this machine cannot run images: {self.problem}"}
        if not sandboxed:
            return {"images": "", "images_detail": f"this machine cannot run images: {NEEDS_SANDBOX}"}
        return {"images": "skopeo+umoci", "images_detail": f"image store at {self.root}"}

    def set_budget(self, budget_bytes: int | None) -> None:
        self._budget = budget_bytes or DEFAULT_BUDGET_BYTES
        if self._store is not None:
            self._store.budget_bytes = self._budget

    def held(self) -> tuple[HeldImage, ...]:
        if self._store is None:
            return ()
        return tuple(
            HeldImage(digest=image.digest, references=image.references, bytes=image.bytes)
            for image in self._store.held()
        )

    def have(self, pull: ImagePull, *, cancel: Cancel | None = None, deadline: float) -> Pulled:
        """``pull``'s image in the store (pulled now or held); raises ImageError, PullCancelled."""
        store = self.store
        if store is None:
            raise ImageError(ImageFailure.UNUSABLE, f"this machine cannot run images: {self.problem}")
        try:
            ref = parse(pull.reference)
        except ValueError as exc:
            raise ImageError(ImageFailure.NOT_FOUND, str(exc)) from None
        return store.ensure(ref, auth=pull.auth, deadline=deadline, cancel=cancel or threading.Event())

    def prefetch(self, pulls: Sequence[ImagePull], stop: threading.Event) -> tuple[ImagePulled, ...]:
        """A pool member's images, pulled before its handshake makes it ready; what happened to
        each (a failure is reported, and the member still becomes ready)."""
        done = []
        for pull in pulls:
            if stop.is_set():
                break
            if pull.auth is not None:
                register_secret(pull.auth.password)  # never in the agent's log
            started = time.monotonic()
            try:
                got = self.have(pull, cancel=stop, deadline=started + pull.timeout_seconds)
            except ImageError as exc:
                log.warning("could not pull the pool's image %s: %s", pull.reference, exc.detail)
                done.append(ImagePulled(reference=pull.reference, code=exc.code, detail=exc.detail[:500]))
                continue
            except PullCancelled:
                break
            log.info(
                "pool image %s: %s (%s)",
                pull.reference,
                f"pulled {got.bytes / 1e6:.1f} MB in {got.seconds:.1f} s" if got.pulled else "already here",
                got.image.digest,
            )
            done.append(
                ImagePulled(
                    reference=pull.reference,
                    digest=got.image.digest,
                    pulled=got.pulled,
                    bytes=got.bytes,
                    seconds=round(got.seconds, 3),
                )
            )
        return tuple(done)

    def for_job(self, job: JobPayload, *, cancel: Cancel, started: float, sandboxed: bool) -> Pulled:
        """The job's image, within its pull deadline (and its own timeout), counted from
        ``started`` (when the job became this machine's)."""
        assert job.image is not None
        if not sandboxed:
            raise ImageError(ImageFailure.UNUSABLE, f"this machine cannot run images: {NEEDS_SANDBOX}")
        limit = job.image.timeout_seconds
        if job.timeout_seconds:
            limit = min(limit, job.timeout_seconds)
        return self.have(job.image, cancel=cancel, deadline=started + limit)


def image_dir_for(work_dir: str | None) -> str | None:
    """Where the store lives: beside the work root (the machine's folder, hidden from jobs), or
    a folder of its own when the work root is a temporary one."""
    if work_dir is None:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(work_dir)), "images")
