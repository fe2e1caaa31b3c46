"""Link rates and topology files for ``--hosts netns``: bad input is one line, exit 2, nothing created."""

from __future__ import annotations

import os
import re

import pytest

from ddiloco.cli import main
from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.launch.netns import NS_PREFIX, tag_of
from ddiloco.runtime.launch.topology import Link, load_topology, parse_rate, uniform

LEARNERS = ["learner-0", "learner-1", "learner-2"]

GOOD = """
[sync]
rate = "1gbit"

[[region]]
name = "us-east"
rate = "50mbit"
learners = ["learner-0", "learner-1"]

[[region]]
name = "asia"
up = "5mbit"
down = "10Mbit/s"
learners = ["learner-2"]
"""


def test_rates_are_bits_per_second_with_a_unit() -> None:
    assert parse_rate("20mbit", "x") == 20e6
    assert parse_rate("1.5Gbit/s", "x") == 1.5e9
    assert parse_rate("500kbit", "x") == 500e3
    assert parse_rate("64bit", "x") == 64


def test_a_topology_file_places_every_learner_once(tmp_path) -> None:
    path = tmp_path / "regions.toml"
    path.write_text(GOOD)
    topology = load_topology(path, LEARNERS)
    assert topology.sync == Link(1e9, 1e9)
    assert [(r.name, r.learners) for r in topology.regions] == [("us-east", ("learner-0", "learner-1")),
                                                               ("asia", ("learner-2",))]
    assert topology.region_of("learner-2").link == Link(up_bps=5e6, down_bps=10e6)
    assert uniform(LEARNERS, 2e6).region_of("learner-1").link == Link(2e6, 2e6)


@pytest.mark.parametrize("text, message", [
    (GOOD.replace('"learner-2"]', '"learner-7"]'), "unknown host 'learner-7' (this run has learner-0 .. learner-2)"),
    (GOOD.replace('rate = "50mbit"', 'rate = "0mbit"'), "rate '0mbit' must be positive"),
    (GOOD.replace('rate = "50mbit"', 'rate = "-5mbit"'), "rate '-5mbit' must be positive"),
    (GOOD.replace('rate = "50mbit"', 'rate = "50"'), "rate '50' has no unit"),
    (GOOD.replace('rate = "50mbit"', "rate = 50"), "rate 50 has no unit"),
    (GOOD.replace('rate = "50mbit"', 'rate = "50mb"'), "unknown unit 'mb'"),
    (GOOD.replace('"learner-2"]', '"learner-1"]'), "learner-1 is placed twice (already in region 'us-east')"),
    (GOOD.replace('learners = ["learner-2"]', 'learners = ["learner-0"]'), "learner-0 is placed twice"),
    (GOOD.replace(', "learner-1"]', "]"), "learner-1 is not placed in any region"),
    (GOOD.replace('name = "asia"', 'name = "us-east"'), "region name 'us-east' is used twice"),
    (GOOD.replace('up = "5mbit"', 'rate = "1mbit"\nup = "5mbit"'), "give rate, or up and down, not both"),
    (GOOD + "\n[links]\n", "unknown key 'links'"),
    ("[sync]\n", "expected at least one [[region]] table"),
    ("[[region]\n", "is not valid TOML"),
])
def test_a_bad_topology_is_one_error_naming_it(tmp_path, text, message) -> None:
    path = tmp_path / "regions.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_topology(path, LEARNERS)
    assert str(err.value).startswith(f"topology file {path}") and "\n" not in str(err.value)


def _namespaces_of_this_process() -> list[str]:
    return [n for n in os.listdir("/run/netns") if n.startswith(f"{NS_PREFIX}{tag_of(os.getpid())}-")] \
        if os.path.isdir("/run/netns") else []


@pytest.mark.parametrize("command", ["run", "chaos"])
@pytest.mark.parametrize("extra, message", [
    (("--topology", "{path}"), "unknown host 'learner-7'"),
    (("--link-rate", "0kbit"), "--link-rate: rate '0kbit' must be positive"),
    (("--link-rate", "20"), "--link-rate: rate '20' has no unit"),
])
def test_bad_links_on_the_command_line_are_one_line_exit_2_and_nothing_created(tmp_path, capsys, command, extra,
                                                                            message) -> None:
    path = tmp_path / "regions.toml"
    path.write_text(GOOD.replace('"learner-2"]', '"learner-7"]'))
    out = tmp_path / "out"
    runtime = ["--runtime", "processes"] if command == "run" else []
    argv = [command, *runtime, "--preset", "tiny", "--learners", "3", "--hosts", "netns",
            *[a.format(path=path) for a in extra], "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error: ") and message in err and err.count("\n") == 1
    assert not out.exists() and not _namespaces_of_this_process()


def test_link_options_need_netns_and_netns_needs_processes(capsys) -> None:
    assert main(["run", "--runtime", "processes", "--preset", "tiny", "--link-rate", "5mbit"]) == 2
    assert "--link-rate needs --hosts netns" in capsys.readouterr().err
    assert main(["run", "--preset", "tiny", "--hosts", "netns"]) == 2
    assert "--hosts netns needs --runtime processes" in capsys.readouterr().err


def test_without_root_netns_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = tmp_path / "out"
    assert main(["run", "--runtime", "processes", "--preset", "tiny", "--hosts", "netns", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == ("ddiloco: error: --hosts netns needs root (network namespaces, veth pairs and tc); "
                   "run as root or use --hosts local\n")
    assert not out.exists()
