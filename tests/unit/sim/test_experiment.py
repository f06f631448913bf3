"""swarm.sim.experiment: settings checked up front, and the bundled churn schedule found by name."""

from __future__ import annotations

import pytest

from swarm.planner import synthetic
from swarm.sim.churn import initially_absent, load_schedule
from swarm.sim.experiment import Experiment, churn_planner, schedule_path
from swarm.types import LayerRange, NodeID
from tests.unit.planner.helpers import mesh_cluster, node

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"placements": ("milp", "best")}, "bad placement \\['best'\\]"),
        ({"schedulings": ()}, "bad scheduling"),
        ({"requests": 0}, "--requests must be >= 1"),
        ({"mode": "batch"}, "mode must be online or offline"),
        ({"churn": "no_such_schedule"}, "no churn schedule 'no_such_schedule'"),
        ({"replan": "global"}, "replan must be one of local, scratch"),
    ],
)
def test_bad_settings_fail_before_any_planning(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Experiment("helix24", **settings)  # type: ignore[arg-type]


def test_bundled_churn_schedule_by_name_or_path() -> None:
    path = schedule_path("churn_helix24")
    assert path.name == "churn_helix24.json" and schedule_path(str(path)) == path
    events = load_schedule(path, synthetic.helix_24())
    assert [(e.time_s, e.joins) for e in events] == [
        (60, False),
        (90, False),
        (120, False),
        (180, True),
        (240, True),
    ]
    assert initially_absent(events) == set()  # every node named leaves first, so all start in the swarm


def test_churn_replans_locally_as_the_live_planner_does() -> None:
    # n3 left, but n2 still holds its layers: the local re-plan moves nobody (a full re-solve may).
    present = {NodeID("n0"): LayerRange(0, 4), NodeID("n1"): LayerRange(0, 4), NodeID("n2"): LayerRange(4, 8)}
    cluster = mesh_cluster([node(f"n{i}", 4, 400.0) for i in range(3)], 8)
    exp = Experiment("helix24", plan_time_limit_s=2.0, replan="local")
    assert churn_planner(exp, "milp")(cluster, present).placement == present
