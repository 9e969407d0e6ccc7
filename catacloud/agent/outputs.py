"""A job's files that outlive its command: the checkpoint restored before it starts and the
output files uploaded after it ends (the agent's work loop calls both; catacloud/agent/files.py
holds the file handling they share with the checkpointer)."""

from __future__ import annotations

import contextlib
import logging
import os
import tarfile
import tempfile
import threading
import time

from catacloud.agent.client import AgentAPIError, AgentClient, Gone, Job, Unauthorized, redact
from catacloud.agent.files import (
    MAX_ARTIFACT_BYTES,
    OutputFile,
    clear_dir,
    display_name,
    extract_archive,
    url_quote_name,
)
from catacloud.agent.runner import Cancellation

log = logging.getLogger("catacloud.agent")

FINISHED_RETRY_SECONDS = 300.0
STOPPING_RETRY_SECONDS = 10.0
RESTORE_ATTEMPTS = 3


def restore_checkpoint(
    client: AgentClient, job: Job, directory: str, cancel: Cancellation, *, tmp_dir: str
) -> None:
    """Fetch the job's last checkpoint into ``directory`` before its command starts.

    Failures are retried a few times, then the job starts anyway (it sees what it finds)."""
    try:
        fd, archive = tempfile.mkstemp(prefix=".catacloud-restore-", suffix=".tar.gz", dir=tmp_dir)
        os.close(fd)
    except OSError as exc:
        log.error("job %s: cannot restore its checkpoint (%s); starting it without", job.id, exc)
        return
    try:
        for attempt in range(RESTORE_ATTEMPTS):
            if attempt:
                clear_dir(directory)
                if cancel.wait(client.backoff(attempt - 1)):
                    return
            try:
                if not client.get_checkpoint(job.id, archive):
                    log.info("job %s: no checkpoint to restore", job.id)
                    return
                skipped = extract_archive(archive, directory)
            except Unauthorized:
                raise
            except (AgentAPIError, OSError, tarfile.TarError, EOFError) as exc:
                log.warning(
                    "job %s: restoring the checkpoint failed (attempt %d of %d): %s",
                    job.id,
                    attempt + 1,
                    RESTORE_ATTEMPTS,
                    " ".join(redact(str(exc)).split()),  # tarfile's errors span lines
                )
                continue
            log.info(
                "job %s: checkpoint restored (%d bytes%s)",
                job.id,
                os.path.getsize(archive),
                f", {len(skipped)} unsafe entries skipped" if skipped else "",
            )
            return
        log.error("job %s: could not restore its checkpoint; starting it without", job.id)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(archive)


def upload_outputs(
    client: AgentClient,
    job: Job,
    outputs: list[OutputFile],
    *,
    stopping: threading.Event,
    awaited: bool = True,
) -> None:
    """Upload the job's output files one by one, then post ``uploads-done``. Without files,
    nothing is posted when the control plane does not await it (``awaited`` False: ``finished``
    said ``uploads_pending: 0`` and it released the machine then; a request less per job)."""
    if not outputs and not awaited:
        return
    failed: list[dict[str, str]] = []
    stopping_deadline: float | None = None
    try:
        for index, output in enumerate(outputs):
            if stopping.is_set() and stopping_deadline is None:
                stopping_deadline = time.monotonic() + STOPPING_RETRY_SECONDS
            name = display_name(output.name)
            if stopping_deadline is not None and time.monotonic() > stopping_deadline:
                failed.extend(
                    {"name": display_name(o.name), "error": "the agent stopped"} for o in outputs[index:]
                )
                break
            try:
                size = os.lstat(output.path).st_size
                if size > MAX_ARTIFACT_BYTES:
                    raise ValueError(f"larger than 5 GiB ({size} bytes); not uploaded")
                answer = client.put_artifact(
                    job.id, url_quote_name(output.name), output.path, deadline=stopping_deadline
                )
            except Unauthorized:
                raise
            except Gone as exc:
                log.warning("job %s: the control plane takes no more outputs (%s)", job.id, exc)
                failed.extend(
                    {"name": display_name(o.name), "error": "refused by the control plane (409)"}
                    for o in outputs[index:]
                )
                break
            except (AgentAPIError, OSError, ValueError) as exc:
                log.warning("job %s: output %r not uploaded: %s", job.id, name, redact(str(exc)))
                failed.append({"name": name, "error": redact(str(exc))})
                continue
            log.info("job %s: output %r uploaded (%s bytes)", job.id, name, answer.get("size"))
    finally:
        try:
            client.uploads_done(
                job.id,
                failed,
                retry_for=STOPPING_RETRY_SECONDS if stopping.is_set() else FINISHED_RETRY_SECONDS,
            )
        except Unauthorized:
            raise
        except AgentAPIError as exc:
            log.error("job %s: could not report the end of its uploads: %s", job.id, exc)
        else:
            if outputs:
                log.info(
                    "job %s: %d of %d outputs uploaded", job.id, len(outputs) - len(failed), len(outputs)
                )
