"""Amazon EC2 driver on boto3.

Config: ``region`` (required), optional ``endpoint_url`` (moto in tests), ``subnet_id``,
``security_group_ids``, ``key_name``, ``max_attempts`` (total attempts per call, 1 = no retry;
botocore's standard mode retries throttling, 5xx and connection errors; default 5),
``page_size`` (describe page size, 5-1000, default 500), ``connect_timeout`` / ``read_timeout``
(s). Credentials: ``access_key_id``, ``secret_access_key``, optional ``session_token``.

``spec.location`` may be empty, the region itself, or an availability zone of it.

Creation is idempotent twice over: ``ClientToken = instance id`` (EC2 returns the original
instance for a repeated token, even when botocore retries a request whose response was lost),
and before launching, ``create`` adopts a live instance already tagged with this instance id
(emulators such as moto ignore ClientToken).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from catacloud.providers.base import (
    LABEL_INSTANCE,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Offering,
    OfferingProblem,
    Permanent,
    Provider,
    ProviderError,
    ProviderMachine,
    QuotaExceeded,
    RateLimited,
    Transient,
)

ERROR_CODES: Mapping[str, type[ProviderError]] = {
    "InsufficientInstanceCapacity": InsufficientCapacity,
    "InsufficientHostCapacity": InsufficientCapacity,
    "InsufficientCapacity": InsufficientCapacity,
    "SpotMaxPriceTooLow": InsufficientCapacity,
    "InstanceLimitExceeded": QuotaExceeded,
    "VcpuLimitExceeded": QuotaExceeded,
    "MaxSpotInstanceCountExceeded": QuotaExceeded,
    "RequestLimitExceeded": RateLimited,
    "Throttling": RateLimited,
    "ThrottlingException": RateLimited,
    "InternalError": Transient,
    "InternalFailure": Transient,
    "Unavailable": Transient,
    "ServiceUnavailable": Transient,
    "RequestTimeout": Transient,
    "InvalidInstanceID.NotFound": NotFound,
    "InvalidInstanceID.Malformed": NotFound,
    "AuthFailure": Permanent,
    "UnauthorizedOperation": Permanent,
    "InvalidParameterValue": Permanent,
    "InvalidParameterCombination": Permanent,
}

# Every state but "terminated": what list() reports and delete() may still have to end.
LISTED_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")
_RESERVED_TAG_PREFIX = "aws:"


def map_error(exc: BaseException) -> ProviderError:
    """Translate a botocore exception into the provider error hierarchy."""
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        cls = ERROR_CODES.get(code)
        if cls is None:
            cls = Transient if status >= 500 else Permanent  # InvalidAMIID.*, Invalid*, ...
        return cls(f"aws: {code}: {error.get('Message', '')}")
    if isinstance(exc, BotoConnectionError | HTTPClientError):
        return Transient(f"aws: {type(exc).__name__}: {exc}")
    return Permanent(f"aws: {type(exc).__name__}: {exc}")  # no credentials, invalid parameters


def _past(stamp: Any) -> bool:
    """An EC2 time (a string like ``2026-01-01T00:00:00.000Z``, or a datetime) that has passed."""
    if isinstance(stamp, str):
        try:
            stamp = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            return False
    return isinstance(stamp, datetime) and stamp <= datetime.now(UTC)


def _runs(kind: Mapping[str, Any], image: Mapping[str, Any]) -> bool:
    """Whether an instance type's processor runs an AMI's architecture (x86_64, arm64, ...)."""
    supported = kind.get("ProcessorInfo", {}).get("SupportedArchitectures")
    return not supported or image.get("Architecture") in supported


class AwsProvider(Provider):
    kind = "aws"
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = {
        "pending": MachineState.PROVISIONING,
        "running": MachineState.RUNNING,
        "shutting-down": MachineState.STOPPING,
        "stopping": MachineState.STOPPING,
        "stopped": MachineState.STOPPING,
        "terminated": MachineState.GONE,
    }

    checks_offerings = True
    spot_notices = "ec2"

    def __init__(self, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> None:
        super().__init__(config=config, credentials=credentials)
        cfg = self.config
        self.region = str(cfg.get("region") or "")
        if not self.region:
            raise Permanent("aws provider needs config 'region'")
        if not (self.credentials.get("access_key_id") and self.credentials.get("secret_access_key")):
            raise Permanent("aws provider needs credentials 'access_key_id' and 'secret_access_key'")
        self.page_size = int(cfg.get("page_size", 500))
        if not 5 <= self.page_size <= 1000:
            raise Permanent("page_size must be between 5 and 1000")
        session = boto3.session.Session(
            aws_access_key_id=self.credentials["access_key_id"],
            aws_secret_access_key=self.credentials["secret_access_key"],
            aws_session_token=self.credentials.get("session_token") or None,
            region_name=self.region,
        )
        self.client = session.client(
            "ec2",
            endpoint_url=cfg.get("endpoint_url") or None,
            config=Config(
                retries={"mode": "standard", "total_max_attempts": int(cfg.get("max_attempts", 5))},
                connect_timeout=float(cfg.get("connect_timeout", 10)),
                read_timeout=float(cfg.get("read_timeout", 60)),
                user_agent_extra="catacloud",
            ),
        )

    # ---- the interface ------------------------------------------------------------------------

    def create(self, spec: MachineSpec) -> ProviderMachine:
        if len(spec.instance_id) > 64:
            raise Permanent("instance id too long for an EC2 ClientToken (max 64)")
        existing = [m for m in self.list({LABEL_INSTANCE: spec.instance_id}) if m.alive]
        if existing:
            return existing[0]
        try:
            response = self.client.run_instances(**self._run_params(spec))
        except (ClientError, BotoCoreError) as exc:
            raise map_error(exc) from exc
        return self._machine(response["Instances"][0])

    def get(self, provider_id: str) -> ProviderMachine:
        try:
            response = self.client.describe_instances(InstanceIds=[provider_id])
        except (ClientError, BotoCoreError) as exc:
            raise map_error(exc) from exc
        instances = [i for r in response.get("Reservations", []) for i in r.get("Instances", [])]
        if not instances:
            raise NotFound(f"aws: no instance {provider_id}")
        return self._machine(instances[0])

    def list(self, owner_labels: Mapping[str, str]) -> list[ProviderMachine]:
        # The state filter first: EC2 does not care, emulators that filter in order get cheaper.
        filters = [{"Name": "instance-state-name", "Values": list(LISTED_STATES)}]
        filters += [{"Name": f"tag:{k}", "Values": [v]} for k, v in sorted(owner_labels.items())]
        paginator = self.client.get_paginator("describe_instances")
        try:
            return [
                self._machine(instance)
                for page in paginator.paginate(Filters=filters, PaginationConfig={"PageSize": self.page_size})
                for reservation in page.get("Reservations", [])
                for instance in reservation.get("Instances", [])
            ]
        except (ClientError, BotoCoreError) as exc:
            raise map_error(exc) from exc

    def delete(self, provider_id: str) -> None:
        try:
            self.client.terminate_instances(InstanceIds=[provider_id])
        except (ClientError, BotoCoreError) as exc:
            error = map_error(exc)
            if isinstance(error, NotFound):
                return  # never existed or long gone: done
            raise error from exc
        # Terminating an already terminated instance succeeds at EC2: nothing else to handle.

    def check_offerings(self, offerings: Sequence[Offering]) -> Sequence[OfferingProblem]:
        """Each offering against the region's own lists, one call each (paged):
        DescribeInstanceTypes and DescribeImages filtered to the names asked for (a name that
        does not exist is simply absent), DescribeAvailabilityZones. An AMI whose architecture
        the instance type does not support is refused as RunInstances would refuse it."""
        names = sorted({o.server_type for o in offerings if o.server_type})
        amis = sorted({o.image for o in offerings if o.image})
        try:
            types = {
                t["InstanceType"]: t
                for t in self._all("describe_instance_types", "InstanceTypes", "instance-type", names)
            }
            images = {i["ImageId"]: i for i in self._all("describe_images", "Images", "image-id", amis)}
            zones = {z["ZoneName"]: z for z in self.client.describe_availability_zones()["AvailabilityZones"]}
        except (ClientError, BotoCoreError) as exc:
            raise map_error(exc) from exc
        return [p for o in offerings for p in self._problems(o, types, images, zones)]

    # ---- helpers ------------------------------------------------------------------------------

    def _all(self, operation: str, key: str, name: str, values: Sequence[str]) -> Sequence[dict[str, Any]]:
        if not values:
            return []
        filters = [{"Name": name, "Values": [*values]}]
        pages = self.client.get_paginator(operation).paginate(Filters=filters)
        return [item for page in pages for item in page.get(key, [])]

    def _problems(
        self,
        offering: Offering,
        types: Mapping[str, Mapping[str, Any]],
        images: Mapping[str, Mapping[str, Any]],
        zones: Mapping[str, Mapping[str, Any]],
    ) -> Sequence[OfferingProblem]:
        found: builtins.list[OfferingProblem] = []

        def say(message: str, refused: bool = True) -> None:
            found.append(OfferingProblem(offering, f"aws: {message}", refused))

        kind = types.get(offering.server_type)
        if kind is None:
            say(f"no instance type {offering.server_type!r} is offered in {self.region}")
        elif offering.arch and offering.arch not in (
            supported := kind.get("ProcessorInfo", {}).get("SupportedArchitectures") or [offering.arch]
        ):
            say(
                f"instance type {offering.server_type} is {', '.join(supported)}, "
                f"not {offering.arch} as its machine type says"
            )
        image = images.get(offering.image)
        if image is None:
            say(f"no image {offering.image!r} in {self.region} that this account may launch")
        elif image.get("State", "available") != "available":
            say(f"image {offering.image!r} is {image['State']}")
        elif kind is not None and not _runs(kind, image):
            arch = image.get("Architecture")
            say(f"image {offering.image!r} is {arch}: {offering.server_type} cannot run it")
        elif _past(image.get("DeprecationTime")):
            say(f"image {offering.image!r} is deprecated since {image['DeprecationTime']}", refused=False)
        location = offering.location
        if location and location != self.region and location not in zones:
            say(f"no availability zone {location!r} in {self.region} (zones: {', '.join(sorted(zones))})")
        return found

    def _run_params(self, spec: MachineSpec) -> dict[str, Any]:
        labels = {**spec.labels, LABEL_INSTANCE: spec.instance_id}
        tags = [{"Key": k, "Value": v} for k, v in sorted({**labels, "Name": spec.name}.items())]
        params: dict[str, Any] = {
            "ClientToken": spec.instance_id,
            "ImageId": spec.image,
            "InstanceType": spec.server_type,
            "MinCount": 1,
            "MaxCount": 1,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
            # The instance metadata service answers only IMDSv2 (a session token from a PUT) and
            # only one hop away: the agent reaches it, a container behind a bridge does not. Jobs
            # never do: their network namespace refuses link-local (catacloud/agent/netns.py).
            "MetadataOptions": {
                "HttpTokens": "required",
                "HttpPutResponseHopLimit": 1,
                "HttpEndpoint": "enabled",
            },
        }
        if user_data := spec.cloud_init_for(self.spot_notices):  # a spot machine's agent watches IMDS
            params["UserData"] = user_data  # boto3 base64-encodes it
        if spec.spot:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        if spec.location and spec.location != self.region:
            if not spec.location.startswith(self.region):
                raise Permanent(f"aws: location {spec.location!r} is not in region {self.region}")
            params["Placement"] = {"AvailabilityZone": spec.location}
        if self.config.get("subnet_id"):
            params["SubnetId"] = self.config["subnet_id"]
        if self.config.get("security_group_ids"):
            params["SecurityGroupIds"] = list(self.config["security_group_ids"])
        if self.config.get("key_name"):
            params["KeyName"] = self.config["key_name"]
        return params

    def _machine(self, instance: Mapping[str, Any]) -> ProviderMachine:
        tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
        raw = instance.get("State", {}).get("Name", "unknown")
        launched = instance.get("LaunchTime")
        return ProviderMachine(
            provider_id=instance["InstanceId"],
            name=tags.get("Name", instance["InstanceId"]),
            state=self.map_state(raw),
            labels={k: v for k, v in tags.items() if k != "Name" and not k.startswith(_RESERVED_TAG_PREFIX)},
            created_at=launched if isinstance(launched, datetime) else None,
            public_ip=instance.get("PublicIpAddress", ""),
            private_ip=instance.get("PrivateIpAddress", ""),
            raw_state=raw,
        )
