"""RPC between clients and peers over hivemind P2P: ``call_<verb>`` for callers, ``serve`` for peers."""

from swarm.transport.calls import (
    DEFAULT_TIMEOUT_S,
    call_close,
    call_handover,
    call_info,
    call_move,
    call_probe,
    call_step,
    call_step_acked,
    call_step_batch,
    call_wait,
    call_wait_batch,
    measure_link,
)
from swarm.transport.serving import RpcHandler, dispatch, serve

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RpcHandler",
    "call_close",
    "call_handover",
    "call_info",
    "call_move",
    "call_probe",
    "call_step",
    "call_step_acked",
    "call_step_batch",
    "call_wait_batch",
    "call_wait",
    "dispatch",
    "measure_link",
    "serve",
]
