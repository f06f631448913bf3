"""Planner solves run in a niced child process of their own, so serving never waits for one."""

from __future__ import annotations

import asyncio
import os

import pytest

from swarm.peer.solver_process import NICENESS, SolverProcess
from swarm.planner.solve import solve
from swarm.planner.synthetic import helix_24

pytestmark = pytest.mark.timeout(120)


def _where() -> tuple[int, int]:
    return os.getpid(), os.nice(0)


def test_a_solve_runs_in_a_niced_child_and_gives_the_same_plan() -> None:
    cluster = helix_24()

    async def body() -> None:
        solver = SolverProcess()
        try:
            pid, niceness = await solver.run(_where)
            assert pid != os.getpid() and niceness >= os.nice(0) + min(NICENESS, 19 - os.nice(0))
            there = await solver.run(solve, cluster, method="greedy", time_limit_s=5.0)
        finally:
            solver.close()
        here = solve(cluster, method="greedy", time_limit_s=5.0)
        assert there.placement == here.placement and there.max_flow_tokens_s == here.max_flow_tokens_s

    asyncio.run(body())
