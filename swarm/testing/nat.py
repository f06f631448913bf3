"""The NAT case: a peer no one can dial holds the middle layers; it must serve through a public peer's relay.

    with LocalSwarm(tmp_path, model="tiny") as swarm:
        result = nat_relay_case(swarm)               # loopback: the middle peer listens nowhere (--no-listen)
    result["nat_relay_ok"]                           # True: served through a relay, greedy tokens equal

    with EmulatedNet("fsr", ["p0", "p1", "nat", "cl"], nat_hosts=["nat"]) as net, \
            LocalSwarm(tmp_path, net=net) as swarm:
        result = nat_relay_case(swarm, hosts=("p0", "p1", "nat"), client_host="cl")   # behind a real NAT

Two public peers hold the first and last thirds of the model; the third peer, which no one can dial, holds the
middle. A client process (``python -m client.cli --prompt-ids``) then generates greedily. The result says
whether the middle peer announced only circuit addresses, logged that it serves through a relay, and whether
the session through it gave the reference's tokens.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from swarm.dht.node import RELAY_FAILED, RELAY_OK
from swarm.models.loading import resolve_model
from swarm.testing.launcher import REPO, LocalSwarm, PeerProcess
from swarm.testing.reference import greedy_reference

PROMPT_IDS = (5, 17, 42, 3, 99, 7, 11, 23)
FIXED_LAYERS = ("--no-follow-plan",)  # the middle peer must keep the middle layers the case gives it


def nat_relay_case(
    swarm: LocalSwarm,
    *,
    hosts: Sequence[str] | None = None,
    client_host: str | None = None,
    relay: bool = True,
    new_tokens: int = 8,
    timeout_s: float = 120.0,
    prompt_ids: Sequence[int] = PROMPT_IDS,
) -> dict[str, Any]:
    """Start the three peers in ``swarm`` (empty), run one greedy session, and report (see the module doc).

    ``hosts``: the (public, public, behind-NAT) hosts of ``swarm.net`` the peers run on, and ``client_host``
    the client's; None runs all on loopback, the middle peer listening nowhere. ``relay`` False starts the
    middle peer with --no-relay-when-unreachable: it must then say why it cannot serve.

    Keys: ``nat_relay_ok``, ``relayed`` (only circuit addresses announced, and the relay line logged),
    ``tokens_equal``, ``through_nat_peer`` (the session's route used it), ``relay_line`` (the peer's verdict:
    relayed, or exactly why not), ``nat_ready_s``, ``tokens``, ``route``, ``reference``."""
    public0, public1, behind = hosts if hosts is not None else (None, None, None)
    num_layers = resolve_model(swarm.model).spec.num_layers
    third = num_layers // 3
    swarm.start_peer(f"0:{third}", name="public0", extra_args=FIXED_LAYERS, timeout_s=timeout_s, host=public0)
    last = f"{num_layers - third}:{num_layers}"
    swarm.start_peer(last, name="public1", extra_args=FIXED_LAYERS, timeout_s=timeout_s, host=public1)
    nat_args = [*FIXED_LAYERS, *(["--no-listen"] if behind is None else [])]
    nat_args += [] if relay else ["--no-relay-when-unreachable"]
    nat = swarm.start_peer(
        f"{third}:{num_layers - third}", name="nat", extra_args=nat_args, wait=False, host=behind
    )
    line = wait_for_verdict(nat, timeout_s)
    result: dict[str, Any] = {"relay_line": line, "nat_ready_s": None, "tokens": [], "route": []}
    relayed = line.startswith(RELAY_OK)
    if relayed:
        nat.wait_ready(timeout_s)
        relayed = all("/p2p-circuit/" in m for m in nat.maddrs)
        result["nat_ready_s"] = nat.ready_after_s
    if relayed:
        result.update(generate(swarm, new_tokens, timeout_s, client_host, prompt_ids))
    source = resolve_model(swarm.model)
    result["reference"] = _until_eos(greedy_reference(source, prompt_ids, new_tokens), source.tokenizer())
    result["relayed"] = relayed
    result["through_nat_peer"] = relayed and nat.peer_id in result["route"]
    result["tokens_equal"] = result["tokens"] == result["reference"]
    result["nat_relay_ok"] = bool(result["through_nat_peer"] and result["tokens_equal"])
    return result


def generate(
    swarm: LocalSwarm,
    new_tokens: int,
    timeout_s: float,
    host: str | None,
    prompt_ids: Sequence[int] = PROMPT_IDS,
) -> dict[str, Any]:
    """{"tokens", "route"} of one greedy session after ``prompt_ids``, from a client process of its own (in
    ``host``'s namespace when given)."""
    argv = [
        sys.executable,
        "-m",
        "client.cli",
        "--initial-peers",
        *swarm.initial_peers,
        "--model",
        swarm.model,
    ]
    argv += ["--prompt-ids", ",".join(map(str, prompt_ids)), "--max-new-tokens", str(new_tokens), "--json"]
    if host is None:
        proc = subprocess.Popen(argv, env=swarm.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    else:
        proc = swarm.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the client failed ({proc.returncode}):\n{err.decode(errors='replace')[-3000:]}")
    reply: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return reply


def wait_for_verdict(peer: PeerProcess, timeout_s: float) -> str:
    """The peer's log line saying it serves through a relay, or why it cannot (the line's text from the
    marker on); TimeoutError with the log's tail when neither appears in ``timeout_s``."""
    pattern = re.compile(f"({re.escape(RELAY_OK)}|{re.escape(RELAY_FAILED)}).*")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = pattern.search(peer.log_tail(200_000))
        if found:
            return found.group(0)
        if peer.proc.poll() is not None:
            raise RuntimeError(f"peer {peer.name} exited with {peer.proc.returncode}:\n{peer.log_tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"peer {peer.name} said neither that it relays nor why not:\n{peer.log_tail()}")


def _until_eos(tokens: list[int], tokenizer: Any) -> list[int]:
    """The reference's tokens before its first EOS: the client stops there (the tiny model has no tokenizer and
    no EOS, so all of them)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return tokens[: tokens.index(eos)] if eos in tokens else tokens
