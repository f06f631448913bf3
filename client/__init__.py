"""The FlowSwarm Python client.

from client import SwarmClient
with SwarmClient(initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/Qm..."]) as swarm:
    for piece in swarm.stream(messages=[{"role": "user", "content": "What is the capital of France?"}]):
        print(piece, end="", flush=True)
"""

from client.client import AsyncSwarmClient, SwarmClient
from client.config import ClientConfig

__all__ = ["AsyncSwarmClient", "ClientConfig", "SwarmClient"]
