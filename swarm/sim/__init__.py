"""FlowSwarm's event-driven serving simulator: the engine behind scripts/simulate.py and scripts/calibrate.py.

It imports swarm.planner and swarm.routing unchanged, so what it measures is the placement and routing code
that runs live; it imports nothing of the peer, the DHT or the transport (tests/unit/test_layering.py).
Modules, each owning one part: timing (per-node compute models), hosts (processes sharing a machine's cores),
trace (request lengths and arrivals), config (SimConfig), records (event kinds and the shared Node, Link,
Requests, Counters records), events (EventQueue: the clock and the heap), links (Network: FIFO pipes), view
(SwarmView: what the router sees, cache reservations), batching (Batcher: per-node iterations), moves (Moves:
partial replay, KV hand-over), sessions (Sessions: admission, failover), client_side (Client: the LM head),
engine (Simulation: builds the parts and dispatches events), scheduling (iwrr / random / swarm routers), churn
(peers joining and leaving), report (tables, JSON, plots), experiment (placements x schedulings on one trace:
scripts/simulate.py), split_phases (split prefill/decode routes against single routes: simulate.py --split-phases),
calibration (closed-loop predictions for scripts/calibrate.py). Each imports only modules
before it in this list (tests/unit/test_import_cycles.py keeps them free of cycles).
data/churn_helix24.json is an example churn schedule for the helix24 cluster.
"""
