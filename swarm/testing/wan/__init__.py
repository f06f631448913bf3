"""Emulated wide-area networks for tests and benchmarks: hosts in network namespaces, a userspace delay line
with a one-way delay and a bandwidth per ordered pair, and home-router NATs (``net.py``, ``router.py``)."""

from swarm.testing.wan.net import EmulatedNet, LinkSpec, namespaces_unavailable

__all__ = ["EmulatedNet", "LinkSpec", "namespaces_unavailable"]
