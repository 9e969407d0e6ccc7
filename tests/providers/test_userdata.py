"""cloud-init user data for cloud machines."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from catacloud.providers import MachineSpec, Permanent
from catacloud.providers.base import Bootstrap
from catacloud.providers.userdata import render_user_data

TOKEN = "bt_3q2-Xy9_ZkP0aLm7Qw4RtY"
WHEEL = "https://cc.example.com/api/agent/v1/dist/catacloud_agent-1.2.3-py3-none-any.whl#sha256=" + "ab" * 32


def render(**kwargs: Any) -> dict[str, Any]:
    text = render_user_data(
        **{"agent_url": "https://cc.example.com/agent", "bootstrap_token": TOKEN, **kwargs}
    )
    assert text.startswith("#cloud-config\n")
    return yaml.safe_load(text)


def file_at(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return next(f for f in doc["write_files"] if f["path"] == path)


def test_token_file_is_root_only_and_holds_just_the_token() -> None:
    doc = render()
    token_file = file_at(doc, "/etc/catacloud/bootstrap-token")
    assert token_file["permissions"] == "0600"
    assert token_file["owner"] == "root:root"
    assert token_file["content"] == TOKEN


def test_agent_is_installed_in_a_venv_and_started_by_systemd() -> None:
    doc = render(package=WHEEL)
    assert doc["runcmd"][0] == ["python3", "-m", "venv", "/opt/catacloud"]
    assert doc["runcmd"][1] == ["/opt/catacloud/bin/pip", "install", "--upgrade", WHEEL]
    assert ["systemctl", "enable", "--now", "catacloud-agent.service"] in doc["runcmd"]
    unit = file_at(doc, "/etc/systemd/system/catacloud-agent.service")["content"]
    assert (
        "ExecStart=/opt/catacloud/bin/catacloud agent --url https://cc.example.com/agent "
        "--bootstrap-token-file /etc/catacloud/bootstrap-token"
    ) in unit
    assert "Restart=always" in unit


def test_the_machine_types_disk_gb_reaches_the_agent_which_bounds_its_jobs_disk_with_it() -> None:
    unit = file_at(render(disk_gb=40), "/etc/systemd/system/catacloud-agent.service")["content"]
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(" --work-dir /var/lib/catacloud/work --disk-gb 40")
    unit = file_at(render(), "/etc/systemd/system/catacloud-agent.service")["content"]
    assert "--disk-gb" not in unit  # no disk_gb: no area, the watchdog keeps the host's reserve


def test_token_appears_only_in_the_token_file() -> None:
    text = render_user_data(agent_url="https://cc.example.com/agent", bootstrap_token=TOKEN)
    assert text.count(TOKEN) == 1
    unit = file_at(yaml.safe_load(text), "/etc/systemd/system/catacloud-agent.service")["content"]
    assert TOKEN not in unit


def test_percent_and_dollar_in_url_are_escaped_for_systemd() -> None:
    unit = file_at(
        render(agent_url="https://cc.example.com/a%20b?x=$y"), "/etc/systemd/system/catacloud-agent.service"
    )["content"]
    assert "--url https://cc.example.com/a%%20b?x=$$y " in unit


@pytest.mark.parametrize(
    "kwargs",
    [
        {"agent_url": "https://cc.example.com/\nruncmd: [reboot]"},
        {"agent_url": "https://cc.example.com/ --evil"},
        {"agent_url": "ftp://cc.example.com/"},
        {"agent_url": "https:///no-host"},
        {"agent_url": 'https://cc.example.com/"'},
        {"bootstrap_token": TOKEN + "\nssh_authorized_keys: [x]"},
        {"bootstrap_token": "short"},
        {"bootstrap_token": "with space and more than sixteen"},
        {"package": "--index-url=https://evil.example/simple"},
        {"package": "catacloud\n- [rm, -rf, /]"},
        {"package": "catacloud ; rm -rf /"},
        # never a name from a public index, nor a wheel without its digest
        {"package": "catacloud-agent"},
        {"package": "catacloud-agent==0.1.0"},
        {"package": WHEEL.split("#")[0]},
        {"package": WHEEL[:-1]},
        {"package": WHEEL.replace("catacloud_agent-", "other-")},
        {"package": WHEEL + " --index-url=https://evil.example/simple"},
        {"disk_gb": 0},
        {"disk_gb": "40 --no-sandbox"},
    ],
)
def test_unsafe_inputs_are_rejected(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        render(**kwargs)


def test_a_cloud_machine_is_never_made_without_the_wheel_its_control_plane_serves() -> None:
    """Bootstrap (what every driver renders user data from) refuses, typed as permanent, when
    the control plane serves no wheel: the machine fails saying so instead of booting without an
    agent or installing one from a public index."""
    with pytest.raises(Permanent, match="serves no agent wheel.*CATACLOUD_AGENT_WHEEL"):
        Bootstrap(agent_url="https://cc.example.com", token=TOKEN).user_data()
    text = Bootstrap(agent_url="https://cc.example.com", token=TOKEN, package=WHEEL).user_data()
    install = [cmd for cmd in yaml.safe_load(text)["runcmd"] if "install" in cmd]
    assert install == [["/opt/catacloud/bin/pip", "install", "--upgrade", WHEEL]]


def exec_start(text: str) -> str:
    unit = file_at(yaml.safe_load(text), "/etc/systemd/system/catacloud-agent.service")["content"]
    return next(line for line in unit.splitlines() if line.startswith("ExecStart="))


@pytest.mark.parametrize("kind", ["ec2", "azure"])
def test_a_spot_machines_agent_watches_its_metadata_service_for_the_notice(kind: str) -> None:
    """Without --imds-url the agent never looks: a spot machine's job would die with it, unwarned."""
    line = exec_start(
        render_user_data(agent_url="https://cc.example.com", bootstrap_token=TOKEN, spot_notices=kind)
    )
    assert line.endswith(f" --imds-url http://169.254.169.254 --imds-kind {kind}")
    assert "--imds" not in exec_start(
        render_user_data(agent_url="https://cc.example.com", bootstrap_token=TOKEN)
    )
    with pytest.raises(ValueError, match="spot_notices"):
        render_user_data(agent_url="https://cc.example.com", bootstrap_token=TOKEN, spot_notices="gcp --evil")


def test_only_spot_machines_of_a_provider_with_notices_watch_for_them() -> None:
    bootstrap = Bootstrap(agent_url="https://cc.example.com", token=TOKEN, package=WHEEL)

    def spec(spot: bool) -> MachineSpec:
        return MachineSpec(
            instance_id="i-1", labels={}, server_type="t", image="i", spot=spot, bootstrap=bootstrap
        )

    assert "--imds-kind ec2" in exec_start(spec(spot=True).cloud_init_for("ec2"))
    assert "--imds" not in exec_start(spec(spot=False).cloud_init_for("ec2"))  # on-demand: no notices
    assert "--imds" not in exec_start(spec(spot=True).cloud_init_for(""))  # a provider without them
    assert spec(spot=True).cloud_init == spec(spot=True).cloud_init_for("")


def test_a_containers_machine_installs_the_jobs_engine_and_no_other_does() -> None:
    packages = render(containers=True)["packages"]
    assert {"podman", "crun", "docker-compose", "netavark", "aardvark-dns", "slirp4netns", "iptables"} <= set(
        packages
    )
    assert "podman" not in render()["packages"]  # a type without the setting gets no engine
    spec = MachineSpec(
        instance_id="1",
        labels={},
        server_type="cx22",
        image="debian-12",
        containers=True,
        bootstrap=Bootstrap(agent_url="https://cc.example.com/agent", token=TOKEN, package=WHEEL),
    )
    assert "podman" in yaml.safe_load(spec.cloud_init)["packages"]
