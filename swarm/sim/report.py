"""Results of a run as the JSON row of scripts/simulate.py, and plots (matplotlib, when installed)."""

from __future__ import annotations

import logging
from typing import Any

from swarm.sim.engine import SNK, SRC, Simulation

logger = logging.getLogger(__name__)


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, p50, p99 (nearest rank); zeros for an empty list."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    n = len(ordered)
    return {
        "mean": sum(ordered) / n,
        "p50": ordered[min(n - 1, int(0.50 * n))],
        "p99": ordered[min(n - 1, int(0.99 * n))],
    }


def summarize(sim: Simulation, placement: str, scheduling: str) -> dict[str, Any]:
    """One row: decode throughput, latencies, lost requests, utilisation, link queueing."""
    trace = sim.trace
    done = [r for r in range(len(trace)) if sim.requests.done_s[r] >= 0]
    start_s = min(req.arrival_s for req in trace)
    end_s = max((sim.requests.done_s[r] for r in done), default=start_s)
    span_s = max(end_s - start_s, 1e-9)
    tokens = sum(sim.requests.generated)
    prompt = [sim.requests.first_token_s[r] - trace[r].arrival_s for r in done]
    decode = [
        (sim.requests.done_s[r] - sim.requests.first_token_s[r]) / (trace[r].output_tokens - 1)
        for r in done
        if trace[r].output_tokens > 1
    ]
    util = {str(n.id): n.busy_s / span_s for n in sim.nodes if n.busy_s > 0}
    waits = [(link.wait_s, link.messages, link) for link in sim.network.links.values() if link.messages]
    total_wait = sum(w for w, _, _ in waits)
    messages = sum(m for _, m, _ in waits)

    def name(i: int) -> str:
        return "source" if i == SRC else "sink" if i == SNK else str(sim.ids[i])

    busiest = sorted(waits, key=lambda w: -w[0])[:5]
    # Online runs end with a drain (no new arrivals, the last sessions finishing) that dilutes tokens / span;
    # this is the rate while requests were still arriving, from whole throughput buckets.
    last_arrival_s = max(req.arrival_s for req in trace)
    whole = int(last_arrival_s / sim.config.bucket_s)
    while_arriving = sum(sim.client.buckets[:whole]) / (whole * sim.config.bucket_s) if whole > 0 else None
    return {
        "placement": placement,
        "scheduling": scheduling,
        "max_flow_tokens_s": sim.plan.max_flow_tokens_s,
        "decode_tokens_s": tokens / span_s,
        "decode_tokens_s_while_arriving": while_arriving,
        "prompt_latency_s": percentiles(prompt),
        "decode_latency_s": percentiles(decode),
        "completed_requests": len(done),
        "lost_requests": len(trace) - len(done),
        "failovers": sim.counters.failovers,
        "restarts": sim.counters.restarts,
        "handovers": sim.counters.handovers,
        "handover_bytes": sim.counters.handover_bytes,
        "replayed_tokens": sim.counters.replayed_tokens,
        "stalled_at_end": len(sim.moves.stalled),
        "simulated_s": span_s,
        "node_utilisation": {
            "mean": sum(util.values()) / len(sim.nodes) if sim.nodes else 0.0,
            "max": max(util.values(), default=0.0),
            "per_node": {k: round(v, 4) for k, v in sorted(util.items())},
        },
        "link_queueing_s": {
            "mean_per_message": total_wait / messages if messages else 0.0,
            "total": total_wait,
            "busiest": {f"{name(lk.src)}->{name(lk.dst)}": round(w, 4) for w, _, lk in busiest},
        },
        "throughput_timeline": {
            "bucket_s": sim.config.bucket_s,
            "tokens_s": [round(b / sim.config.bucket_s, 2) for b in sim.client.buckets],
        },
    }


WINDOW_S = 30.0  # the window for the lowest throughput after a leave
HORIZON_S = 60.0  # windows starting this long after a leave still count as "after" it


def window_tokens_s(timeline: dict[str, Any], start_s: float, window_s: float = WINDOW_S) -> float:
    """Mean tokens/s over [start_s, start_s + window_s) from whole buckets of a throughput timeline."""
    bucket, rates = timeline["bucket_s"], timeline["tokens_s"]
    first, count = int(round(start_s / bucket)), max(int(round(window_s / bucket)), 1)
    part = rates[first : first + count]
    return sum(part) / count if part else 0.0


def churn_targets(row: dict[str, Any], references: dict[str, Any]) -> dict[str, Any]:
    """Issue 13's figures for one churn row: per leave, the lowest 30 s window (starting 0-60 s after it)
    against the same window of the churn-free run on the nodes that remain, and failovers against the
    sessions that were on the leaving node (failovers: sessions that had to replay; hand-overs apart)."""
    leaves = []
    for e in row["churn_events"]:
        if e["event"] == "join":
            continue
        ref = references[f"{e['time_s']:g}"]
        bucket = row["throughput_timeline"]["bucket_s"]
        windows = []
        for k in range(int(HORIZON_S / bucket) + 1):
            t = e["time_s"] + k * bucket
            got = window_tokens_s(row["throughput_timeline"], t)
            steady = window_tokens_s(ref["throughput_timeline"], t)
            windows.append((got / steady if steady > 0 else 1.0, t, got, steady))
        ratio, t, got, steady = min(windows)
        leaves.append(
            {
                "time_s": e["time_s"],
                "node": e["node"],
                "min_window_ratio": round(ratio, 3),
                "min_window_start_s": t,
                "min_window_tokens_s": round(got, 1),
                "steady_tokens_s": round(steady, 1),
                "sessions_on_leaving_node": e["sessions_on_node"],
                "failovers": e["failovers"],
                "handovers": e["handovers"],
                "nodes_moved": e.get("nodes_moved"),
            }
        )
    ratio = min((x["min_window_ratio"] for x in leaves), default=1.0)
    within = all(x["failovers"] <= x["sessions_on_leaving_node"] for x in leaves)
    return {
        "placement": row["placement"],
        "scheduling": row["scheduling"],
        "churn_mode": row.get("churn_mode"),
        "min_window_ratio": ratio,
        "failovers_per_leave": sum(x["failovers"] for x in leaves) / max(len(leaves), 1),
        "handovers_per_leave": sum(x["handovers"] for x in leaves) / max(len(leaves), 1),
        "sessions_on_leaving_node": sum(x["sessions_on_leaving_node"] for x in leaves) / max(len(leaves), 1),
        "restarts": row["restarts"],
        "lost": row["lost_requests"],
        "met": {
            "min_window_ratio>=0.7": ratio >= 0.7,
            "failovers<=sessions_on_leaving_node": within,
            "lost==0": row["lost_requests"] == 0,
            "restarts==0": row["restarts"] == 0,
        },
        "leaves": leaves,
    }


def plot_churn(result: dict[str, Any], path: str) -> bool:
    """Throughput over time of every row (old and new churn behaviour) and the churn-free references, in one
    plot, with the churn events marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written to %s", path)
        return False
    fig, ax = plt.subplots(figsize=(11, 5))
    for r in result["rows"]:
        tl = r["throughput_timeline"]
        xs = [(i + 0.5) * tl["bucket_s"] for i in range(len(tl["tokens_s"]))]
        label = f"{r['placement']}/{r['scheduling']}, churn {r.get('churn_mode', '')}"
        ax.plot(xs, tl["tokens_s"], label=label, lw=1.6 if r.get("churn_mode") == "new" else 1.0)
    seen: set[int] = set()
    for name, refs in result.get("references", {}).items():
        for ref in refs.values():
            if ref["nodes"] in seen:
                continue
            seen.add(ref["nodes"])
            tl = ref["throughput_timeline"]
            xs = [(i + 0.5) * tl["bucket_s"] for i in range(len(tl["tokens_s"]))]
            ax.plot(xs, tl["tokens_s"], ls=":", lw=0.9, label=f"{name}, no churn, {ref['nodes']} nodes")
    events = result["rows"][0].get("churn_events", []) if result["rows"] else []
    for e in events:
        ax.axvline(e["time_s"], color="grey", lw=0.6, ls="--")
        ax.text(
            e["time_s"],
            ax.get_ylim()[1] * 0.97,
            f" {e['event']} {e['node']}",
            fontsize=6,
            rotation=90,
            va="top",
        )
    ax.set_xlabel("simulated s")
    ax.set_ylabel("decode tokens/s (10 s buckets)")
    ax.set_title(
        f"{result['cluster']}: throughput over time, churn behaviour before (old) and after (new) issue 13"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Bar charts of throughput and latency per (placement, scheduling), plus throughput over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written to %s", path)
        return False
    labels = [f"{r['placement']}\n{r['scheduling']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(max(12, len(rows) * 1.2), 4.5))
    axes[0].bar(labels, [r["decode_tokens_s"] for r in rows])
    axes[0].set_title("decode tokens/s")
    axes[1].bar(labels, [r["decode_latency_s"]["mean"] for r in rows])
    axes[1].set_title("mean decode latency per token, s")
    for r in rows:
        timeline = r["throughput_timeline"]
        xs = [i * timeline["bucket_s"] for i in range(len(timeline["tokens_s"]))]
        axes[2].plot(xs, timeline["tokens_s"], label=f"{r['placement']}/{r['scheduling']}")
    axes[2].set_title("throughput over time, tokens/s")
    axes[2].set_xlabel("simulated s")
    axes[2].legend(fontsize=6)
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
