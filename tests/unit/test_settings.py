"""Settings written once: the CLI is generated from the config dataclasses, defaults and checks included."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from swarm.peer.config import FollowConfig, PeerConfig, PlannerConfig, SessionConfig
from swarm.settings import add_arguments, component, from_arguments, setting


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, PeerConfig)
    return parser


def _leaves(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("component"):
            names += _leaves(hints[f.name], f.metadata["prefix"] or prefix)
        else:
            names.append(f"{prefix}_{f.name}" if prefix else f.name)
    return names


def test_no_arguments_give_the_default_config() -> None:
    assert from_arguments(PeerConfig, _parser().parse_args([])) == PeerConfig()


def test_every_leaf_setting_is_one_option_with_help() -> None:
    actions = {a.dest: a for a in _parser()._actions if a.dest != "help"}
    assert sorted(actions) == sorted(_leaves(PeerConfig))
    assert all(a.help for a in actions.values())


def test_options_reach_nested_components_and_each_loop_has_its_own_knob() -> None:
    args = _parser().parse_args(
        ["--planner-check-interval-s", "2", "--follow-check-interval-s", "7", "--session-idle-timeout-s", "9",
         "--no-plan", "--no-relay", "--announce-maddr", "/ip4/1.2.3.4/tcp/5", "--layers", "0:4"]
    )  # fmt: skip
    config = from_arguments(PeerConfig, args)
    assert config.planner == PlannerConfig(check_interval_s=2.0)
    assert config.follow == FollowConfig(check_interval_s=7.0)
    assert config.sessions == SessionConfig(idle_timeout_s=9.0)
    assert (config.plan, config.follow_plan, config.layers) == (False, True, "0:4")
    assert not config.reachability.use_relay and config.reachability.announce_maddrs == (
        "/ip4/1.2.3.4/tcp/5",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache-tokens", "0"], "cache_tokens must be positive"),
        (["--follow-check-interval-s", "0"], "check_interval_s must be positive"),
        (["--layers", "5:2"], "bad layer range"),
        (["--session-max-open", "-1"], "max_open must be positive"),
    ],
)
def test_bad_values_are_refused_by_the_configs_own_checks(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_arguments(PeerConfig, _parser().parse_args(argv))


@dataclasses.dataclass(frozen=True)
class _NoHelp:
    x: int = 1


@dataclasses.dataclass(frozen=True)
class _TrueSwitch:
    on: bool = setting(True, "on by default")


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _TrueSwitch = component(_TrueSwitch)


@pytest.mark.parametrize("cls", [_NoHelp, _Outer])
def test_a_field_without_help_or_a_true_switch_without_a_flag_is_refused(cls: type) -> None:
    with pytest.raises(TypeError):
        add_arguments(argparse.ArgumentParser(), cls)
