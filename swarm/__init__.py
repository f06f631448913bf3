"""FlowSwarm: LLM serving on a peer-to-peer swarm of volunteer GPUs."""

PROTOCOL_VERSION = 2  # 2: "wait" and "step_ack" (the last hop answers the client directly)
