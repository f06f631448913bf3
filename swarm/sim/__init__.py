"""FlowSwarm's event-driven serving simulator: the engine behind scripts/simulate.py and scripts/calibrate.py.

It imports swarm.planner and swarm.routing unchanged, so what it measures is the placement and routing code
that runs live; it imports nothing of the peer, the DHT or the transport (tests/unit/test_layering.py).
Modules: timing (per-node compute models), hosts (processes sharing a machine's cores), trace (request
lengths and arrivals), engine (the Simulation and its event loop) with records (event kinds, Node, Link),
batching (per-node iterations), links (FIFO pipes), client_side (the LM head) and sessions (admission,
failover), scheduling (iwrr / random / swarm routers), churn (peers joining and leaving), moves (partial
replay, KV hand-over), report (tables, JSON, plots), experiment (placements x schedulings on one
trace: scripts/simulate.py), calibration (closed-loop predictions for scripts/calibrate.py).
data/churn_helix24.json is an example churn schedule for the helix24 cluster.
"""
