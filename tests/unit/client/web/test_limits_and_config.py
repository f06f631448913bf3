"""The rate limiter and generation slots (injected clock, no sleeping), and the CLI built from WebConfig."""

from __future__ import annotations

import asyncio
from dataclasses import fields

import pytest

from client.config import ClientConfig
from client.web.config import WebConfig, build_parser, parse_config
from client.web.errors import APIError
from client.web.limits import GenerationSlots, RateLimiter
from swarm.codec import ActivationConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_limit_allows_a_burst_then_the_rate_per_address() -> None:
    clock = Clock()
    limiter = RateLimiter(per_min=60, burst=3, clock=clock)
    for _ in range(3):
        limiter.check("a")
    with pytest.raises(APIError) as caught:
        limiter.check("a")
    assert caught.value.status == 429 and caught.value.type == "rate_limit_error"
    limiter.check("b")  # another address has its own bucket
    clock.now = 1.0  # one request per second refills
    limiter.check("a")
    with pytest.raises(APIError):
        limiter.check("a")


def test_full_buckets_are_forgotten() -> None:
    clock = Clock()
    limiter = RateLimiter(per_min=60, burst=2, clock=clock)
    for address in ("a", "b", "c"):
        limiter.check(address)
    clock.now = 10.0
    limiter.check("d")
    assert set(limiter._buckets) == {"d"}


def test_generation_slots_queue_then_429() -> None:
    async def scenario() -> None:
        slots = GenerationSlots(running=1, queued=1)
        release = asyncio.Event()

        async def hold() -> None:
            async with slots.slot():
                await release.wait()

        first = asyncio.create_task(hold())
        await asyncio.sleep(0)
        second = asyncio.create_task(hold())  # waits in the queue
        await asyncio.sleep(0)
        assert (slots.running, slots.waiting) == (1, 1)
        with pytest.raises(APIError) as caught:
            await slots.acquire()
        assert caught.value.status == 429 and caught.value.code == "queue_full"
        release.set()
        await asyncio.gather(first, second)
        assert (slots.running, slots.waiting) == (0, 0)

    asyncio.run(scenario())


def test_every_config_field_is_a_flag_with_its_default_and_help() -> None:
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    leaves = [(f.name, f) for f in fields(WebConfig) if f.name != "client"]
    leaves += [(f"client_{f.name}", f) for f in fields(ClientConfig) if not f.metadata.get("component")]
    # the client's activations component keeps its own prefix: --activations, --activations-auto-fraction
    leaves += [(f"activations_{f.name}", f) for f in fields(ActivationConfig)]
    for dest, f in leaves:
        assert dest in flags and flags[dest].help.startswith(f.metadata["help"])
    config = parse_config(
        ["--initial-peers", "/ip4/1", "/ip4/2", "--max-tokens-limit", "10", "--default-max-tokens", "5"]
    )
    client = ClientConfig(initial_peers=("/ip4/1", "/ip4/2"))
    assert config == WebConfig(max_tokens_limit=10, default_max_tokens=5, client=client)
    assert parse_config(["--initial-peers", "x"]).host == "127.0.0.1"  # private unless told otherwise


def test_the_client_settings_come_from_the_client_config_under_a_prefix() -> None:
    default = parse_config(["--initial-peers", "x"]).client
    assert default == ClientConfig(initial_peers=("x",))  # one default per setting: the client's
    argv = ["--initial-peers", "x", "--model", "tiny", "--client-connect-timeout-s", "60"]
    argv += ["--client-step-timeout-s", "7.5", "--client-no-group-messages", "--client-spot-check-seed", "3"]
    client = parse_config(argv).client
    assert (client.model, client.connect_timeout_s, client.step_timeout_s) == ("tiny", 60.0, 7.5)
    assert (client.group_messages, client.spot_check_seed) == (False, 3)
    with pytest.raises(SystemExit):  # the client's own checks apply
        parse_config(["--initial-peers", "x", "--client-step-timeout-s", "0"])


@pytest.mark.parametrize(
    "argv", [["--rate-limit-burst", "0"], ["--port", "70000"], ["--max-tokens-limit", "8"]]
)
def test_bad_settings_exit_with_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--initial-peers", "x", *argv])
