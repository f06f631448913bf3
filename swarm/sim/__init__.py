"""FlowSwarm's event-driven serving simulator: the engine behind scripts/simulate.py.

It imports swarm.planner and swarm.routing unchanged, so what it measures is the placement and routing code
that runs live. Modules: timing (per-node compute models), trace (request lengths and arrivals), engine (the
discrete-event simulation), scheduling (iwrr / random / swarm routers), churn (peers joining and leaving),
report (tables, JSON, plots). churn_helix24.json is an example churn schedule for the helix24 cluster.
"""
