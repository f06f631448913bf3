"""``swarm-peer`` command-line errors: bad arguments exit non-zero with a message that says what to fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swarm.peer import cli
from swarm.testing import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _run(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLOWSWARM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "swarm.peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "required: command"),
        (["fly"], "invalid choice"),
        (["join", "--layers", "5:2"], "bad layer range"),
        (["join", "--layers", "abc"], "bad layer range"),
        (["join", "--cache-tokens", "-1"], "must be positive"),
        (["join", "--max-memory-gb", "0"], "must be positive"),
        (["join", "--dtype", "int8"], "invalid choice"),
        (["join", "--quant", "fp3"], "invalid choice"),
        (["join", "--port", "x"], "invalid int value"),
        (["status"], "--initial-peers"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # rejected before anything runs (by argparse, or by the settings' checks): in-process, each case costs no
    # interpreter start
    try:
        code = cli.main(args)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_installed_command_exits_2_with_the_message_too() -> None:
    result = _run("join", "--layers", "5:2", timeout_s=30)
    assert result.returncode == 2, result
    assert "bad layer range" in result.stderr, result.stderr


def test_bad_values_found_at_start_exit_2_with_a_message() -> None:
    result = _run("join", "--model", "/nonexistent/checkpoint")
    assert result.returncode == 2 and "neither 'default'" in result.stderr, result.stderr
    result = _run("join", "--device", "tpu")
    assert result.returncode == 2 and "unknown device" in result.stderr, result.stderr
    result = _run("join", "--model", "tiny", "--layers", "0:99", "--port", "0")
    assert result.returncode == 2 and "past the last layer" in result.stderr, result.stderr
