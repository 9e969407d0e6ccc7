"""AwsProvider with real boto3 against moto's server on loopback.

Moto accepts every request, so faults are injected into botocore itself: a ``before-send``
handler answers with an EC2 error document (parsed by the real botocore parser), and an
``after-call`` handler raises a read timeout after the request took effect (a lost response).
"""

from __future__ import annotations

import base64
import logging
import random
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import yaml
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ReadTimeoutError

from catacloud.providers import (
    LABEL_INSTALLATION,
    LABEL_INSTANCE,
    LABEL_POOL,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Offering,
    Permanent,
    ProviderError,
    QuotaExceeded,
    RateLimited,
    Transient,
    build_provider,
)
from catacloud.providers.aws import AwsProvider
from catacloud.providers.base import Bootstrap
from testkit.processes import free_port
from testkit.servers import moto_server

REGION = "eu-central-1"
WHEEL = "https://cc.example.com/api/agent/v1/dist/catacloud_agent-1.2.3-py3-none-any.whl#sha256=" + "ab" * 32
CREDENTIALS = {"access_key_id": "AKIAFAKEFAKEFAKE", "secret_access_key": "moto-secret-key-123"}


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with moto_server() as url:
        yield url


@pytest.fixture(scope="module")
def ec2(moto_url: str) -> Any:
    return boto3.client(
        "ec2",
        region_name=REGION,
        endpoint_url=moto_url,
        aws_access_key_id="inspector",
        aws_secret_access_key="inspector",
    )


@pytest.fixture(scope="module")
def ami(ec2: Any) -> str:
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


@pytest.fixture()
def installation() -> dict[str, str]:
    """A fresh installation label per test: the moto server is shared, and resetting it is slow."""
    return {LABEL_INSTALLATION: f"test-{uuid.uuid4().hex[:12]}"}


def make_provider(moto_url: str, **config: Any) -> AwsProvider:
    provider = build_provider(
        "aws",
        config={"region": REGION, "endpoint_url": moto_url, "max_attempts": 1, **config},
        credentials=CREDENTIALS,
    )
    assert isinstance(provider, AwsProvider)
    return provider


@pytest.fixture()
def provider(moto_url: str, ec2: Any) -> AwsProvider:
    return make_provider(moto_url)


class Faults:
    """Inject EC2 errors and lost responses into one provider's botocore client."""

    def __init__(self, provider: AwsProvider) -> None:
        self.queue: dict[str, deque[tuple[str, int]]] = {}
        self.sent: Counter[str] = Counter()
        events = provider.client.meta.events
        events.register("before-send.ec2", self._before_send)
        events.register("after-call.ec2", self._after_call)

    def fail_next(self, operation: str, code: str, *, status: int = 400, times: int = 1) -> None:
        self.queue.setdefault(operation, deque()).extend([(code, status)] * times)

    def lose_next_response(self, operation: str, *, times: int = 1) -> None:
        self.queue.setdefault(operation, deque()).extend([("lose", 0)] * times)

    def clear(self) -> None:
        self.queue.clear()

    def _peek(self, operation: str) -> tuple[str, int] | None:
        queue = self.queue.get(operation)
        return queue[0] if queue else None

    def _before_send(self, request: Any, event_name: str, **kwargs: Any) -> AWSResponse | None:
        operation = event_name.rsplit(".", 1)[-1]
        self.sent[operation] += 1
        fault = self._peek(operation)
        if fault is None or fault[0] == "lose":
            return None
        self.queue[operation].popleft()
        code, status = fault
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
            f"<Code>{code}</Code><Message>injected {code}</Message>"
            "</Error></Errors><RequestID>fault-1</RequestID></Response>"
        ).encode()
        return AWSResponse(request.url, status, {"Content-Type": "text/xml"}, _Raw(body))

    def _after_call(self, event_name: str, **kwargs: Any) -> None:
        operation = event_name.rsplit(".", 1)[-1]
        fault = self._peek(operation)
        if fault is not None and fault[0] == "lose":
            self.queue[operation].popleft()
            raise ReadTimeoutError(endpoint_url="injected lost response")


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **kwargs: Any) -> Iterator[bytes]:
        yield self.body


def make_spec(ami: str, installation: dict[str, str], **fields: Any) -> MachineSpec:
    instance_id = str(uuid.uuid4())
    labels = {**installation, LABEL_INSTANCE: instance_id, **fields.pop("labels", {})}
    return MachineSpec(instance_id=instance_id, labels=labels, server_type="t3.micro", image=ami, **fields)


def tagged(ec2: Any, instance_id: str, *, live_only: bool = True) -> list[dict]:
    filters = [{"Name": f"tag:{LABEL_INSTANCE}", "Values": [instance_id]}]
    if live_only:
        filters.append({"Name": "instance-state-name", "Values": ["pending", "running"]})
    return [i for r in ec2.describe_instances(Filters=filters)["Reservations"] for i in r["Instances"]]


# ---- create -------------------------------------------------------------------------------------


def test_create_launches_a_tagged_instance_with_user_data(
    ec2: Any, ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    spec = make_spec(
        ami, installation, labels={LABEL_POOL: "p1"}, user_data="#cloud-config\n", location="eu-central-1b"
    )
    machine = provider.create(spec)

    assert machine.state in (MachineState.PROVISIONING, MachineState.RUNNING)
    assert machine.name == f"cc-{spec.instance_id}"
    assert machine.labels == {**installation, LABEL_INSTANCE: spec.instance_id, LABEL_POOL: "p1"}
    (instance,) = tagged(ec2, spec.instance_id)
    assert instance["InstanceId"] == machine.provider_id
    assert instance["ImageId"] == ami
    assert instance["InstanceType"] == "t3.micro"
    assert instance["ClientToken"] == spec.instance_id
    assert instance["Placement"]["AvailabilityZone"] == "eu-central-1b"
    assert {"Key": "Name", "Value": spec.name} in instance["Tags"]
    user_data = ec2.describe_instance_attribute(InstanceId=machine.provider_id, Attribute="userData")
    assert base64.b64decode(user_data["UserData"]["Value"]).decode() == spec.user_data
    volumes = ec2.describe_volumes(Filters=[{"Name": f"tag:{LABEL_INSTANCE}", "Values": [spec.instance_id]}])
    assert len(volumes["Volumes"]) == 1
    assert "InstanceLifecycle" not in instance  # on-demand
    # The metadata service: IMDSv2 only, one hop (a job's namespace never reaches it anyway).
    assert instance["MetadataOptions"]["HttpTokens"] == "required"
    assert instance["MetadataOptions"]["HttpPutResponseHopLimit"] == 1


def test_spot_specs_request_one_time_spot(
    ec2: Any, ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    machine = provider.create(make_spec(ami, installation, spot=True))
    (instance,) = ec2.describe_instances(InstanceIds=[machine.provider_id])["Reservations"][0]["Instances"]
    assert instance["InstanceLifecycle"] == "spot"


def test_a_spot_instances_agent_watches_imds_for_the_interruption_an_on_demand_ones_does_not(
    ec2: Any, ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    """A spot machine's agent is started with --imds-url: without it, nobody reads the two-minute
    notice and the job dies with the machine, its checkpoint unsaved."""
    bootstrap = Bootstrap(agent_url="https://cc.example.com", token="bt_0123456789abcdefXYZ", package=WHEEL)

    def exec_start(instance_id: str) -> str:
        attribute = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
        document = yaml.safe_load(base64.b64decode(attribute["UserData"]["Value"]))
        unit = next(f["content"] for f in document["write_files"] if f["path"].endswith(".service"))
        return next(line for line in unit.splitlines() if line.startswith("ExecStart="))

    spot = provider.create(make_spec(ami, installation, spot=True, bootstrap=bootstrap))
    on_demand = provider.create(make_spec(ami, installation, bootstrap=bootstrap))
    assert exec_start(spot.provider_id).endswith(" --imds-url http://169.254.169.254 --imds-kind ec2")
    assert "--imds" not in exec_start(on_demand.provider_id)


def test_create_twice_launches_one_instance(
    ec2: Any, ami: str, moto_url: str, installation: dict[str, str]
) -> None:
    spec = make_spec(ami, installation)
    first = make_provider(moto_url).create(spec)
    second = make_provider(moto_url).create(spec)
    assert second.provider_id == first.provider_id
    assert len(tagged(ec2, spec.instance_id)) == 1  # moto ignores ClientToken: the tag lookup did this


def test_a_lost_create_response_is_adopted_on_retry(
    ec2: Any, ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    faults = Faults(provider)
    faults.lose_next_response("RunInstances")
    spec = make_spec(ami, installation)

    with pytest.raises(Transient):
        provider.create(spec)
    assert len(tagged(ec2, spec.instance_id)) == 1  # it was launched nevertheless

    machine = provider.create(spec)
    assert [i["InstanceId"] for i in tagged(ec2, spec.instance_id)] == [machine.provider_id]
    assert faults.sent["RunInstances"] == 1


def test_a_terminated_instance_is_not_adopted(
    ec2: Any, ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    spec = make_spec(ami, installation)
    old = provider.create(spec)
    provider.delete(old.provider_id)
    new = provider.create(spec)
    assert new.provider_id != old.provider_id


def test_a_location_outside_the_region_is_permanent(
    ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    with pytest.raises(Permanent, match="not in region"):
        provider.create(make_spec(ami, installation, location="us-east-1a"))


# ---- errors and retries -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, status, error",
    [
        ("InsufficientInstanceCapacity", 500, InsufficientCapacity),
        ("InsufficientHostCapacity", 400, InsufficientCapacity),
        ("InsufficientCapacity", 400, InsufficientCapacity),
        ("SpotMaxPriceTooLow", 400, InsufficientCapacity),
        ("InstanceLimitExceeded", 400, QuotaExceeded),
        ("VcpuLimitExceeded", 400, QuotaExceeded),
        ("MaxSpotInstanceCountExceeded", 400, QuotaExceeded),
        ("RequestLimitExceeded", 503, RateLimited),
        ("Throttling", 400, RateLimited),
        ("InternalError", 500, Transient),
        ("Unavailable", 503, Transient),
        ("ServiceUnavailable", 503, Transient),
        ("AuthFailure", 401, Permanent),
        ("UnauthorizedOperation", 403, Permanent),
        ("InvalidParameterValue", 400, Permanent),
        ("InvalidAMIID.NotFound", 400, Permanent),
        ("InvalidAMIID.Malformed", 400, Permanent),
        ("SomethingNew", 400, Permanent),
        ("SomethingNewButServerSide", 502, Transient),
    ],
)
def test_run_instances_errors_are_typed(
    ec2: Any,
    ami: str,
    provider: AwsProvider,
    code: str,
    status: int,
    error: type[ProviderError],
    installation: dict[str, str],
) -> None:
    Faults(provider).fail_next("RunInstances", code, status=status)
    spec = make_spec(ami, installation)
    with pytest.raises(error) as info:
        provider.create(spec)
    assert type(info.value) is error
    assert code in str(info.value)
    assert tagged(ec2, spec.instance_id) == []


def test_throttling_is_retried_by_botocore_then_succeeds(
    ec2: Any, ami: str, moto_url: str, installation: dict[str, str]
) -> None:
    provider = make_provider(moto_url, max_attempts=3)
    faults = Faults(provider)
    faults.fail_next("RunInstances", "RequestLimitExceeded", status=503)
    machine = provider.create(make_spec(ami, installation))
    assert machine.provider_id.startswith("i-")
    assert faults.sent["RunInstances"] == 2


def test_unreachable_endpoint_is_transient(installation: dict[str, str]) -> None:
    provider = make_provider(f"http://127.0.0.1:{free_port()}", connect_timeout=1)
    with pytest.raises(Transient):
        provider.list(installation)


def test_bad_configuration_is_permanent(moto_url: str) -> None:
    with pytest.raises(Permanent, match="region"):
        build_provider("aws", config={}, credentials=CREDENTIALS)
    with pytest.raises(Permanent, match="credentials"):
        build_provider("aws", config={"region": REGION}, credentials={"access_key_id": "x"})


def test_secrets_do_not_appear_in_errors(
    ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    Faults(provider).fail_next("RunInstances", "AuthFailure", status=401)
    with pytest.raises(Permanent) as info:
        provider.create(make_spec(ami, installation))
    assert CREDENTIALS["secret_access_key"] not in str(info.value)
    assert CREDENTIALS["access_key_id"] not in str(info.value)


# ---- get / delete / list ----------------------------------------------------------------------------


def test_get_unknown_or_malformed_ids_is_not_found(ec2: Any, provider: AwsProvider) -> None:
    with pytest.raises(NotFound):
        provider.get("i-0123456789abcdef0")
    with pytest.raises(NotFound):
        provider.get("not-an-instance-id")
    faults = Faults(provider)
    faults.fail_next("DescribeInstances", "InvalidInstanceID.Malformed")
    with pytest.raises(NotFound):
        provider.get("i-zz")


def test_delete_is_idempotent_and_the_machine_ends_gone(
    ec2: Any, ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    machine = provider.create(make_spec(ami, installation))
    provider.delete(machine.provider_id)
    provider.delete(machine.provider_id)  # already terminated: still success
    provider.delete("i-0123456789abcdef0")  # never existed
    assert provider.get(machine.provider_id).state is MachineState.GONE
    assert provider.list(installation) == []


def test_delete_errors_other_than_not_found_are_raised(
    ami: str, provider: AwsProvider, installation: dict[str, str]
) -> None:
    machine = provider.create(make_spec(ami, installation))
    Faults(provider).fail_next("TerminateInstances", "UnauthorizedOperation", status=403)
    with pytest.raises(Permanent):
        provider.delete(machine.provider_id)
    assert provider.get(machine.provider_id).alive


def test_list_paginates_and_filters_by_all_labels(
    ec2: Any, ami: str, moto_url: str, installation: dict[str, str]
) -> None:
    provider = make_provider(moto_url, page_size=5)
    faults = Faults(provider)
    mine = {
        provider.create(make_spec(ami, installation, labels={LABEL_POOL: "p1"})).provider_id
        for _ in range(12)
    }
    provider.create(make_spec(ami, installation, labels={LABEL_POOL: "p2"}))
    gone = provider.create(make_spec(ami, installation, labels={LABEL_POOL: "p1"}))
    provider.delete(gone.provider_id)
    faults.sent.clear()

    found = provider.list({**installation, LABEL_POOL: "p1"})

    assert {m.provider_id for m in found} == mine
    assert faults.sent["DescribeInstances"] >= 3  # 12 instances at 5 per page
    assert len(provider.list(installation)) == 13


def test_state_map_covers_every_ec2_state() -> None:
    states = {"pending", "running", "shutting-down", "terminated", "stopping", "stopped"}
    assert set(AwsProvider.STATE_MAP) == states
    assert AwsProvider.map_state("terminated") is MachineState.GONE


# ---- soak ---------------------------------------------------------------------------------------------

FAULTS: list[tuple[str, str, int]] = [
    ("RunInstances", "InsufficientInstanceCapacity", 500),
    ("RunInstances", "RequestLimitExceeded", 503),
    ("RunInstances", "InternalError", 500),
    ("RunInstances", "Unavailable", 503),
    ("RunInstances", "lose", 0),
    ("DescribeInstances", "RequestLimitExceeded", 503),
    ("TerminateInstances", "InternalError", 500),
    ("TerminateInstances", "lose", 0),
]


@pytest.mark.timeout(120)
def test_soak_random_faults_then_reconcile_leaves_exactly_the_live_machines(
    ec2: Any, ami: str, moto_url: str, installation: dict[str, str]
) -> None:
    """Create/delete cycles under random faults (>= 500 operations); a simple reconcile converges."""
    rng = random.Random(1122)
    provider = make_provider(moto_url)
    faults = Faults(provider)
    live: dict[str, str] = {}  # instance id -> provider id: what the database believes is live
    operations = errors = 0

    while operations < 500:
        if rng.random() < 0.3:
            operation, code, status = rng.choice(FAULTS)
            if code == "lose":
                faults.lose_next_response(operation)
            else:
                faults.fail_next(operation, code, status=status)
        if live and rng.random() < 0.45:
            provider_id = live.pop(rng.choice(sorted(live)))  # the row leaves the live states first
            operations += 1
            try:
                provider.delete(provider_id)
            except ProviderError as exc:
                errors += 1
                assert exc.retryable, repr(exc)
            continue
        spec = make_spec(ami, installation)
        for _attempt in range(3):  # the task retries retryable errors
            operations += 1
            try:
                machine = provider.create(spec)
            except ProviderError as exc:
                errors += 1
                assert exc.retryable, repr(exc)  # every injected fault is retryable
            else:
                assert machine.instance_id == spec.instance_id
                live[spec.instance_id] = machine.provider_id
                break

    faults.clear()
    listed = provider.list(installation)
    per_instance = Counter(m.instance_id for m in listed if m.alive)
    assert max(per_instance.values()) == 1  # lost responses were adopted, never launched twice
    extras = [m for m in listed if m.instance_id not in live or m.provider_id != live[m.instance_id]]
    for machine in extras:
        provider.delete(machine.provider_id)

    assert {m.provider_id for m in provider.list(installation) if m.alive} == set(live.values())
    assert {i["InstanceId"] for i in _running(ec2, installation)} == set(live.values())
    assert errors > 0 and extras  # the faults really bit, and reconcile had work to do


def _running(ec2: Any, installation: dict[str, str]) -> list[dict]:
    (key, value), *_ = installation.items()
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": f"tag:{key}", "Values": [value]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


# ---- a catalog's offerings against EC2's lists --------------------------------------------------


def test_offerings_are_checked_against_the_regions_lists_with_one_call_each(
    provider: AwsProvider, ami: str, ec2: Any
) -> None:
    """Given what a catalog names, when checked against EC2 (moto), then an instance type, AMI or
    zone the region does not have is refused, an AMI the type cannot run too, and the rest pass."""
    images = ec2.describe_images(Owners=["amazon"])["Images"]
    arm = next(i["ImageId"] for i in images if i["Architecture"] == "arm64")
    offerings = [
        Offering("m7i.large", ami),
        Offering("m7i.large", ami, f"{REGION}a"),
        Offering("m7i.larg", ami),
        Offering("m7i.large", "ami-0123456789abcdef0"),
        Offering("m7i.large", ami, f"{REGION}z"),
        Offering("m7i.large", arm),
    ]
    sent = Faults(provider).sent
    problems = provider.check_offerings(offerings)
    by = {p.offering: p.message for p in problems}
    assert all(p.refused for p in problems) and set(by) == set(offerings[2:])
    assert by[offerings[2]] == f"aws: no instance type 'm7i.larg' is offered in {REGION}"
    assert "no image 'ami-0123456789abcdef0'" in by[offerings[3]]
    assert f"no availability zone '{REGION}z'" in by[offerings[4]]
    assert "is arm64: m7i.large cannot run it" in by[offerings[5]]
    assert sent == {"DescribeInstanceTypes": 1, "DescribeImages": 1, "DescribeAvailabilityZones": 1}


def test_an_offering_whose_arch_the_instance_type_lacks_is_refused(provider: AwsProvider, ami: str) -> None:
    (refusal,) = provider.check_offerings([Offering("m7i.large", ami, "", "arm64")])
    assert refusal.refused and "not arm64 as its machine type says" in refusal.message
    assert provider.check_offerings([Offering("m7i.large", ami, "", "x86_64")]) == []


def test_checking_offerings_with_a_refused_key_is_a_permanent_error(provider: AwsProvider, ami: str) -> None:
    Faults(provider).fail_next("DescribeInstanceTypes", "AuthFailure", status=401)
    with pytest.raises(Permanent, match="AuthFailure"):
        provider.check_offerings([Offering("m7i.large", ami)])
