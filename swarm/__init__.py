"""FlowSwarm: LLM serving on a peer-to-peer swarm of volunteer GPUs."""

PROTOCOL_VERSION = 1
