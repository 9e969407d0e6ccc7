"""The agent protocol: what the control plane sends an agent and what the agent reports back.

One module, framework-free, that both sides import: the server builds its answers from these
structures (``apps/jobs/selectors.py``, ``apps/control/agent``) and reads the agent's reports
with them; the agent (``catacloud/agent``) parses and writes the same ones. It ships with the
agent's own distribution (``agent/pyproject.toml``), so it imports nothing but the standard
library.

**Versions.** :data:`VERSION` grows when a field's meaning changes or a required one is added.
A new optional field does not bump it: a reader ignores fields it does not know, and a missing
optional field takes its default, so an agent one version behind the control plane (or ahead of
it) still works. An agent reports its version at enrollment; the control plane refuses one
older than :data:`OLDEST_AGENT` with 426 ``agent_upgrade_required`` and a message that says to
upgrade. Agents from before versions were reported count as version 1.

The structures are frozen dataclasses with ``to_json()`` / ``from_json()``; closed sets (a job's
outcome, an output stream, the agent's own error codes) are :class:`enum.StrEnum` members,
whose values are what travels.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

# 1: before versions were reported. 2: the job's network and disk limit, the machine's network
# report, versions reported at enrollment. 3: images (a job's image, a pool's images pulled before
# a member is ready, the machine's image store; Isolation.images says the agent can run them).
VERSION = 3
OLDEST_AGENT = 1


class Outcome(enum.StrEnum):
    """How a job's command ended, as the agent reports it (``finished``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class Stream(enum.StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


class AgentError(enum.StrEnum):
    """Codes of the agent's own answers (to a job over its socket: ``job-meta``, ``checkpoint``)
    and the server's codes the agent acts on."""

    JOB_NOT_RUNNING = "job_not_running"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    INVALID_JOB_TOKEN = "invalid_job_token"
    NOT_FOUND = "not_found"
    UPSTREAM_ERROR = "upstream_error"
    UPGRADE_REQUIRED = "agent_upgrade_required"


class ImageFailure(enum.StrEnum):
    """Why a job's image could not be had: the job ends failed with this code at once (the
    control plane's ``failure_code``; apps.core.errors.ErrorCode has each). Transient faults (a
    registry's 5xx, a cut connection) are retried by the agent, never reported as these."""

    NOT_FOUND = "image_not_found"  # no such repository, tag or digest
    AUTH_FAILED = "image_auth_failed"  # the registry refused the credentials (or asked for some)
    TOO_LARGE = "image_too_large"  # larger than the machine type's image store budget
    DIGEST_MISMATCH = "image_digest_mismatch"  # what came is not what the digest names
    PULL_TIMEOUT = "image_pull_timeout"  # the pull outlived its deadline (the store is cleaned)
    PULL_FAILED = "image_pull_failed"  # the registry stayed unreachable through every retry
    UNUSABLE = "image_unusable"  # pulled, but cannot run here (no /bin/sh, no command, no sandbox)


T = TypeVar("T", bound="Message")


class Message:
    """A protocol structure: a frozen dataclass read from and written to JSON objects."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        """Read ``data``: unknown fields are ignored, missing ones take their default; a missing
        required field or a value of the wrong kind raises ``ValueError``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
        hints = get_type_hints(cls)
        values = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.name in data and data[field.name] is not None:
                try:
                    values[field.name] = _load(hints[field.name], data[field.name])
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{cls.__name__}.{field.name}: {exc}") from None
            elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                if field.name in data:  # null where a value is needed
                    raise ValueError(f"{cls.__name__}.{field.name}: must not be null")
                raise ValueError(f"{cls.__name__}: {field.name} is missing")
        return cls(**values)


def _dump(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_dump(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _dump(v) for k, v in value.items()}
    return value


def _load(hint: Any, value: Any) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        kinds = [a for a in get_args(hint) if a is not type(None)]
        return _load(kinds[0], value)
    if isinstance(hint, type) and issubclass(hint, Message):
        return hint.from_json(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        return tuple(_load(get_args(hint)[0], v) for v in value)
    if origin in (dict, Mapping, typing.Mapping):
        if not isinstance(value, Mapping):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        key, item = get_args(hint)
        return {_load(key, k): _load(item, v) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError(f"expected a number, got {value!r}")
        return hint(value)
    if hint is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise TypeError(f"expected a string, got {value!r}")
        return str(value)
    return value


# ---- the control plane to the agent --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Checkpoint(Message):
    available: bool = False  # a checkpoint of an earlier attempt waits to be restored
    interval_seconds: int | None = None  # save it this often while the job runs


@dataclasses.dataclass(frozen=True)
class Network(Message):
    """What a job may reach besides the internet (``catacloud/agent/netns.py`` reads entries)."""

    allow: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RegistryAuth(Message):
    """The organization's credentials for the image's registry host: the agent writes them to a
    0600 file of its own for the pull alone; the job never sees them."""

    username: str
    password: str


@dataclasses.dataclass(frozen=True)
class RegistryLogin(Message):
    """The organization's credentials for one registry host, for a containers job's engine: the
    agent pulls with them for it (catacloud/agent/registry_proxy.py); the job never gets them."""

    registry: str  # host or host:port, as image references name it
    username: str
    password: str


@dataclasses.dataclass(frozen=True)
class ImagePull(Message):
    """An image to have on the machine: a job's (run inside it) or a pool's (pulled before the
    member is ready). ``reference`` is normalised (catacloud/agent/reference.py); a job's retry
    names the digest its first attempt resolved."""

    reference: str
    auth: RegistryAuth | None = None
    timeout_seconds: float = 900.0  # the pull's deadline


@dataclasses.dataclass(frozen=True)
class JobPayload(Message):
    """One assignment (``GET work`` answers ``{"job": JobPayload}``)."""

    id: str
    command: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # secret values on top
    secret_env_names: tuple[str, ...] = ()  # the agent masks their values in the job's output
    timeout_seconds: int = 0
    attempt: int = 1
    resources: tuple[str, ...] = ()  # resource type ids the job holds (``catacloud job-meta``)
    checkpoint: Checkpoint = Checkpoint()
    network: Network = Network()
    disk_limit_bytes: int | None = None  # the machine type's disk_gb; None: no limit of its own
    image: ImagePull | None = None  # None: the command runs on the machine's own root, as before
    # Its machine type allows containers: the job gets a container engine of its own
    # (catacloud/agent/containers.py). Not for a job inside an image.
    containers: bool = False
    # With ``containers``: the organization's registry credentials, which the engine pulls with
    # through the agent (the job never gets them).
    registries: tuple[RegistryLogin, ...] = ()
    # The job's trace (W3C traceparent; "" when the control plane does not trace): the agent
    # sends it back as the ``traceparent`` header of its reports of this job.
    traceparent: str = ""
    # The exit report may carry the job's last output (``Finished.output``), stored before its
    # end is recorded: a short job's output and end in one request. False (a control plane from
    # before it): the agent posts all output to ``logs`` first.
    final_output: bool = False

    @property
    def secret_values(self) -> list[str]:
        """What the agent masks in the job's output and its own log: the secret env values and
        the password of the image's registry (the job never gets it; masked all the same). The
        ``registries`` passwords are not: the job never gets them either, and a mask over its
        output would tell anyone who reads that output whether a guess of theirs was right."""
        values = [self.env[name] for name in self.secret_env_names if self.env.get(name)]
        if self.image is not None and self.image.auth is not None and self.image.auth.password:
            values.append(self.image.auth.password)
        return values


@dataclasses.dataclass(frozen=True)
class EnrollAnswer(Message):
    instance_id: str
    agent_token: str
    heartbeat_interval: float
    poll_timeout: float
    # The machine type's image store budget, and (a pool's member) the images it pulls before the
    # handshake that makes it ready.
    image_store_bytes: int | None = None
    images: tuple[ImagePull, ...] = ()


@dataclasses.dataclass(frozen=True)
class HeartbeatAnswer(Message):
    cancel: tuple[str, ...] = ()  # jobs to end now
    terminate: bool = False  # the machine is being terminated: stop


# ---- the agent to the control plane ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Isolation(Message):
    """How the machine isolates its jobs (kept on the instance as reported)."""

    jobs: str = ""  # "bubblewrap" | "uid"
    job_uids: str = ""
    proc: str = ""
    bwrap: str = ""
    network: str = ""  # "pasta" | "none" | "host"
    network_detail: str = ""
    images: str = ""  # how it runs a job's image ("skopeo+umoci"); "": it cannot
    images_detail: str = ""


@dataclasses.dataclass(frozen=True)
class Limits(Message):
    """Which resource limits hold on the machine."""

    cpus: int | None = None
    memory_mb: int | None = None
    pids: int | None = None
    enforced: bool = False
    by: str = ""  # "machine": a cloud machine's own size, which its provider enforces
    detail: str = ""
    host_cpus: int | None = None
    cgroup: str = ""
    # The jobs' disk: "file system" (an area of its own, of ``disk_bytes``: the kernel refuses
    # more) or "watchdog" (the agent ends a job over its limit; catacloud/agent/disk.py).
    disk: str = ""
    disk_bytes: int | None = None
    disk_detail: str = ""


@dataclasses.dataclass(frozen=True)
class MachineReport(Message):
    isolation: Isolation = Isolation()
    limits: Limits = Limits()


@dataclasses.dataclass(frozen=True)
class Enroll(Message):
    bootstrap_token: str
    hostname: str = ""
    agent_version: str = ""
    protocol: int = 1  # agents from before versions were reported send none
    machine: MachineReport = MachineReport()


@dataclasses.dataclass(frozen=True)
class LogChunk(Message):
    seq: int
    stream: Stream
    data: str


@dataclasses.dataclass(frozen=True)
class Started(Message):
    """``POST jobs/<id>/started``: ``agent_ms`` is what the agent spent between its poll's
    answer arriving and this report leaving (`catacloud jobs show --timing` shows it)."""

    agent_ms: float = 0.0


@dataclasses.dataclass(frozen=True)
class Finished(Message):
    outcome: Outcome
    exit_code: int | None = None
    reason: str = ""
    uploads_pending: int = 0
    code: str = ""  # an ImageFailure value when the job's image could not be had
    launch_ms: float | None = None  # the start's confirmation -> the command launched
    network: str = ""  # how the job's network came: "ahead" (made before it), "at start", "none"
    # The job's output not delivered yet (when its payload said ``final_output``), in sequence
    # after what ``logs`` took: stored first, as ``logs`` stores it.
    output: tuple[LogChunk, ...] = ()


@dataclasses.dataclass(frozen=True)
class FinishedAnswer(Message):
    """The answer to ``finished``: the job's status as recorded, and whether the machine stays
    held until ``uploads-done`` (``awaits_uploads``: files were announced). When it is false the
    machine was released with the report and the agent posts no ``uploads-done``; a control
    plane that does not say (before this field) always waited for one."""

    status: str = ""
    awaits_uploads: bool = True
    ok: bool = True


@dataclasses.dataclass(frozen=True)
class ImagePulled(Message):
    """How the machine came to hold an image: pulled now (``bytes`` fetched in ``seconds``) or
    found in its store (``pulled`` false); ``code`` and ``detail`` when it could not."""

    reference: str
    digest: str = ""
    pulled: bool = False
    bytes: int = 0
    seconds: float = 0.0
    code: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class HeldImage(Message):
    """One image in the machine's store: its digest, the references it was asked for by, its
    size on disk (its unpacked root and its share of layers)."""

    digest: str
    references: tuple[str, ...] = ()
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ImagesReport(Message):
    """``POST images`` (a pool member's pulls before it is ready) and ``POST jobs/ID/image``
    (a job's): what was pulled, and everything the store now holds (placement prefers a
    machine that holds a job's image)."""

    pulls: tuple[ImagePulled, ...] = ()
    held: tuple[HeldImage, ...] = ()


# ---- enrolled hosts ----------------------------------------------------------------------------
# A host the user owns runs ``catacloud host``: it enrolls once with an enrolment token, then
# exchanges reports (what it has, which slots it runs) for what to start and stop. Each slot is
# a machine of its own on the host (a sandbox with its machine type's cpus, memory and disk, its
# own agent enrolled with the slot's bootstrap token), so a job on a host runs as on any machine.


@dataclasses.dataclass(frozen=True)
class HostCapacity(Message):
    """What a host has (as its agent found it, or was told to offer)."""

    cpus: int
    memory_mb: int
    disk_gb: int = 0  # free space where its slots' disks live
    gpus: int = 0
    arch: str = ""  # platform.machine(): x86_64, aarch64


@dataclasses.dataclass(frozen=True)
class HostEnroll(Message):
    """``POST hosts/enroll``: the enrolment token (single-use or bounded) for the host's own
    credential, returned once."""

    enrolment_token: str
    hostname: str
    capacity: HostCapacity
    agent_version: str = ""
    protocol: int = VERSION


@dataclasses.dataclass(frozen=True)
class HostEnrollAnswer(Message):
    host_id: str
    host_token: str
    heartbeat_interval: float
    poll_timeout: float


@dataclasses.dataclass(frozen=True)
class HostReport(Message):
    """``POST hosts/exchange`` (every heartbeat, or a long poll with ``wait``): the slots the host
    runs now (instance ids) and what it has."""

    running: tuple[str, ...] = ()
    capacity: HostCapacity | None = None


@dataclasses.dataclass(frozen=True)
class SlotStart(Message):
    """One slot the host starts: a sandbox of the slot's size whose agent enrolls with the
    slot's single-use bootstrap token."""

    instance_id: str
    bootstrap_token: str
    cpus: int
    memory_mb: int
    disk_gb: int | None = None
    gpus: int = 0
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class HostAnswer(Message):
    """What the host starts and stops (level-triggered: every answer says it all again until the
    host's report shows it done), and whether it is cordoned."""

    start: tuple[SlotStart, ...] = ()
    stop: tuple[str, ...] = ()
    cordoned: bool = False
