"""Real local swarms for tests, benchmarks and the demo: ``swarm-peer join`` processes on 127.0.0.1, always reaped."""

from swarm.testing.chat import ChatServer, stream_chat
from swarm.testing.launcher import REPO, SWARM_PEER, LocalSwarm, PeerProcess, swarm_client
from swarm.testing.reference import greedy_reference, greedy_tokens

__all__ = [
    "REPO",
    "SWARM_PEER",
    "ChatServer",
    "LocalSwarm",
    "PeerProcess",
    "greedy_reference",
    "greedy_tokens",
    "stream_chat",
    "swarm_client",
]
