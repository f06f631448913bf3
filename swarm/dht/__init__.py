"""The only code that touches hivemind's DHT: signed records, the directory, the planner election.

dht = await SwarmDHT.create(DHTConfig(initial_peers=(...,)), model_hash)   # joins on a worker thread
try:
    p2p = await dht.replicate_p2p()               # for RPC; dht.peer_id, dht.visible_maddrs()
    directory = Directory(dht, DirectoryConfig(ttl_s=30.0))
    snapshot = await directory.snapshot()         # SwarmSnapshot: peers, plan (the lease holder's, checked),
                                                  # planner_peer_id, fetched_at, reports (accused -> reporters)
    await directory.publish_report(ReportRecord(...))   # signed misbehaviour report (swarm.dht.trust)
    coverage(snapshot, num_layers)                # serving peers per layer
    async with asyncio.TaskGroup() as tg:
        tg.create_task(Announcer(directory, current_record).run())   # refresh every ttl/3, withdraw on exit
        tg.create_task(Election(directory, ElectionConfig()).run())  # then PlannerService (swarm.peer)
finally:
    await dht.aclose()                            # stops the DHT child and its p2pd off the loop
                                                  # (dht.shutdown(): the same, blocking, for sync code)
"""

from swarm.dht.directory import Announcer, Directory, DirectoryConfig, SwarmSnapshot, coverage
from swarm.dht.election import Election, ElectionConfig, LeaseBoard
from swarm.dht.lease import LEASE_S, decide, lease_holder
from swarm.dht.node import P2PD_THREADS, DHTConfig, ReachabilityConfig, SwarmDHT
from swarm.dht.schemas import (
    MAX_OLDER_RANGES,
    LeaseRecord,
    LinkMeasure,
    OlderRange,
    PeerRecord,
    PlanRecord,
    ReportRecord,
)
from swarm.dht.trust import ModelShape, excluded_peers

__all__ = [
    "Announcer",
    "DHTConfig",
    "Directory",
    "DirectoryConfig",
    "Election",
    "ElectionConfig",
    "LEASE_S",
    "LeaseBoard",
    "LeaseRecord",
    "LinkMeasure",
    "MAX_OLDER_RANGES",
    "OlderRange",
    "P2PD_THREADS",
    "ModelShape",
    "PeerRecord",
    "PlanRecord",
    "ReachabilityConfig",
    "ReportRecord",
    "SwarmDHT",
    "SwarmSnapshot",
    "coverage",
    "decide",
    "excluded_peers",
    "lease_holder",
]
