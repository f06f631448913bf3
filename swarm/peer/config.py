"""PeerConfig: everything a peer process needs to know, with units in the names. The CLI is built from it."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.types import LayerRange


@dataclass(frozen=True)
class PeerConfig:
    """One peer of the swarm (``swarm-peer join``)."""

    initial_peers: tuple[str, ...] = ()  # multiaddrs of running peers; empty starts a new swarm
    model: str = "default"  # "default" (SmolLM2-135M), "tiny" (random test model) or a checkpoint path
    device: str = "cpu"  # "cpu" or "cuda", "cuda:1", ...
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None: float32 on CPU, checkpoint's on GPU
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # 0 picks a free port
    layers: str = "auto"  # "auto" (least-covered window that fits in memory) or "A:B" for layers [A, B)
    max_memory_gb: float | None = None  # memory budget; None: measured from the device
    cache_tokens: int = 8192  # KV-cache budget in tokens, shared by all sessions (per held layer)
    name: str = ""  # human name in status output; default: the last characters of the peer id
    identity_path: str | None = None  # persistent libp2p key (stable peer id across restarts)
    maddr_file: str | None = None  # write our multiaddrs here once serving and announced
    # Reachability behind NAT, all opt-in (see swarm.dht.ReachabilityConfig; kept plain so the CLI starts fast).
    use_relay: bool = False  # reach and be reached through libp2p circuit relays
    use_auto_relay: bool = False  # look for relays when behind NAT
    nat_port_map: bool = False  # ask the router for a port mapping (UPnP / NAT-PMP)
    auto_nat: bool = False  # run the AutoNAT service
    announce_maddrs: tuple[str, ...] = ()  # public multiaddrs to announce instead of the listening ones
    record_ttl_s: float = 30.0  # our DHT record expires this long after we stop refreshing it
    session_idle_timeout_s: float = 120.0  # close sessions with no step for this long
    shutdown_grace_s: float = 10.0  # on SIGINT/SIGTERM, how long open sessions may finish
    link_refresh_s: float = 30.0  # how often links to other peers are re-measured
    plan: bool = True  # stand as a planner candidate (run the planner service when elected)
    planner_lease_s: float = 30.0  # planner election lease: a dead planner is replaced within two of these
    plan_check_s: float = 5.0  # how often the planner checks the swarm and peers check for a new plan
    follow_plan: bool = True  # move to the layers the published plan gives this peer (swarm.peer.follow)
    handover_timeout_s: float = 60.0  # longest wait for others to take layers we drop when moving

    def __post_init__(self) -> None:
        if self.layers != "auto":
            LayerRange.parse(self.layers)  # raises ValueError with a clear message
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"unknown device {self.device!r}: use cpu, cuda or cuda:N")
        if self.cache_tokens < 1:
            raise ValueError(f"cache_tokens must be positive, got {self.cache_tokens}")
        if self.max_memory_gb is not None and self.max_memory_gb <= 0:
            raise ValueError(f"max_memory_gb must be positive, got {self.max_memory_gb}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range 0..65535")
        for name in (
            "record_ttl_s",
            "session_idle_timeout_s",
            "link_refresh_s",
            "planner_lease_s",
            "plan_check_s",
            "handover_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
