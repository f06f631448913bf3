"""The planner: a pure function from a cluster snapshot to a Plan (layer placement + max-flow edge flows).

    from swarm.planner import solve, max_flow, Cluster, load_cluster

    cluster = load_cluster("cluster.json")            # or Cluster(model, nodes, links) from DHT records
    plan = solve(cluster, method="milp", time_limit_s=TIME_LIMIT_S, current=live_placement, reload_cost=5.0)
    plan.placement      # {node id: LayerRange}, always valid: every layer held, max_layers respected
    plan.flows          # EdgeFlow(src, dst, tokens_s), SOURCE/SINK for the client; routing's IWRR weights
    max_flow(cluster, placement)   # evaluate any placement (method "evaluate")
    link_flow_share(plan, src, dst)   # the fraction of the plan's flow over one link (bench_wan's figure)

No I/O, no global RNG (seeds are parameters); the only clock use is measuring solve_s and honouring
time limits. PlanningError is raised only when no valid placement exists.
"""

from swarm.planner.cluster import (
    Cluster,
    ClusterLink,
    ClusterNode,
    ModelInfo,
    full_mesh_links,
    load_cluster,
    with_full_mesh,
)
from swarm.planner.graph import coverage_score, link_flow_share, max_flow, upper_bound, valid_edges
from swarm.planner.heuristics import petals_greedy, separate_pipelines, swarm_stages
from swarm.planner.milp import TIME_LIMIT_S
from swarm.planner.placement import Placement, check_placement, placement_problems, repair
from swarm.planner.solve import METHODS, solve

__all__ = [
    "METHODS",
    "TIME_LIMIT_S",
    "Cluster",
    "ClusterLink",
    "ClusterNode",
    "ModelInfo",
    "Placement",
    "check_placement",
    "coverage_score",
    "full_mesh_links",
    "link_flow_share",
    "load_cluster",
    "max_flow",
    "petals_greedy",
    "placement_problems",
    "repair",
    "separate_pipelines",
    "solve",
    "swarm_stages",
    "upper_bound",
    "valid_edges",
    "with_full_mesh",
]
