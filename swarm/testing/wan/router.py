"""The userspace delay line: one process holding every host's TUN device, forwarding IPv4 packets between them
after each ordered pair's one-way delay and through its bandwidth queue.

Per ordered pair (src, dst) a packet of ``n`` bytes departs at ``max(now, busy_until) + 8 n / bandwidth`` and
arrives ``delay`` later (never before the pair's previous packet: a link does not reorder). A packet that finds
more than the pair's buffer already queued is dropped, like a router's tail drop, so TCP finds the rate. Packets
to addresses it does not know are dropped; hosts behind a NAT go through their ``Masquerade``.

Started by ``EmulatedNet`` with the TUN fds inherited and its configuration as one JSON argument. Control: one
JSON object a line on stdin, one answer a line on stdout (``{"set": ...}``, ``{"stats": true}``). It exits
when stdin closes, so it never outlives the process that made the network. It imports nothing from the
project (it is started as a script: ``swarm.testing`` would pull in torch).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import selectors
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_READ_BYTES = 65536
_MIN_BUFFER_BYTES = 256 * 1024  # four 64 KB packets: TCP with a large MTU needs a few to keep the link busy
_BUFFER_S = 0.05  # plus 50 ms at the link's rate
_LEAD_WEIGHT = 0.1  # weight of the newest timed wake in the running mean of how late they are
_MAX_LEAD_S = 0.002  # a wake later than this is a descheduled process, not the timer
_NICENESS = -10

# --- the NAT: a home router's masquerade for one host behind it ---------------------------------------------
# Outbound TCP and UDP from the private address leave from the NAT's public address; the private port is kept
# when it is free on the public side, else the next free one is taken (like Linux's MASQUERADE). A mapping
# admits replies only from the remote address and port it was opened towards (a port-restricted cone), and
# every other inbound packet is dropped: nobody can open a connection to the host behind it. Other protocols
# (ICMP) and IP fragments are dropped both ways. Checksums are updated incrementally (RFC 1624).

TCP, UDP = 6, 17
_FIRST_PORT = 1024


def checksum_adjust(checksum: int, old: bytes, new: bytes) -> int:
    """The ones'-complement checksum of a packet after the 16-bit-aligned words ``old`` became ``new``."""
    total = ~checksum & 0xFFFF
    for i in range(0, len(old), 2):
        total += ~((old[i] << 8) | old[i + 1]) & 0xFFFF
        total += (new[i] << 8) | new[i + 1]
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def internet_checksum(data: bytes) -> int:
    """RFC 1071 checksum of ``data`` (for tests and for building packets)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _ports(packet: bytes | bytearray) -> tuple[int, int, int] | None:
    """(protocol, offset of the transport header, offset of its checksum) of an unfragmented TCP/UDP packet."""
    if len(packet) < 20:
        return None
    header = (packet[0] & 0x0F) * 4
    proto = packet[9]
    fragmented = int.from_bytes(packet[6:8], "big") & 0x3FFF  # MF flag or a fragment offset
    if fragmented or proto not in (TCP, UDP):
        return None
    checksum_at = header + (16 if proto == TCP else 6)
    if len(packet) < checksum_at + 2:
        return None
    return proto, header, checksum_at


def _rewrite(packet: bytearray, ip_at: int, port_at: int, ip: bytes, port: bytes, checksum_at: int) -> None:
    """Replace the address at ``ip_at`` and the port at ``port_at``; fix the IPv4 and TCP/UDP checksums."""
    old_ip, old_port = bytes(packet[ip_at : ip_at + 4]), bytes(packet[port_at : port_at + 2])
    packet[ip_at : ip_at + 4], packet[port_at : port_at + 2] = ip, port
    ip_sum = int.from_bytes(packet[10:12], "big")
    packet[10:12] = checksum_adjust(ip_sum, old_ip, ip).to_bytes(2, "big")
    l4_sum = int.from_bytes(packet[checksum_at : checksum_at + 2], "big")
    if packet[9] == UDP and l4_sum == 0:
        return  # a UDP datagram sent without a checksum keeps none
    l4_sum = checksum_adjust(l4_sum, old_ip + old_port, ip + port)
    if packet[9] == UDP and l4_sum == 0:
        l4_sum = 0xFFFF  # 0 means "no checksum" in UDP
    packet[checksum_at : checksum_at + 2] = l4_sum.to_bytes(2, "big")


@dataclass
class Masquerade:
    """The NAT of one private host: ``private`` and ``public`` are 4-byte IPv4 addresses."""

    private: bytes
    public: bytes
    # (proto, private port) -> public port, and back
    _out: dict[tuple[int, bytes], bytes] = field(default_factory=dict)
    _in: dict[tuple[int, bytes], bytes] = field(default_factory=dict)
    # (proto, public port) -> the (remote address + remote port) it may hear from
    _peers: dict[tuple[int, bytes], set[bytes]] = field(default_factory=dict)
    dropped: int = 0

    @classmethod
    def of(cls, private: str, public: str) -> Masquerade:
        return cls(socket.inet_aton(private), socket.inet_aton(public))

    def outbound(self, packet: bytes) -> bytes | None:
        """The packet as it leaves the NAT, or None (dropped)."""
        found = _ports(packet)
        if found is None or packet[12:16] != self.private:
            self.dropped += 1
            return None
        proto, l4, checksum_at = found
        public_port = self._map(proto, packet[l4 : l4 + 2])
        self._peers[proto, public_port].add(packet[16:20] + packet[l4 + 2 : l4 + 4])
        out = bytearray(packet)
        _rewrite(out, 12, l4, self.public, public_port, checksum_at)
        return bytes(out)

    def inbound(self, packet: bytes) -> bytes | None:
        """The packet as it enters the private side, or None: only replies on an open mapping get in."""
        found = _ports(packet)
        if found is None:
            self.dropped += 1
            return None
        proto, l4, checksum_at = found
        key = (proto, packet[l4 + 2 : l4 + 4])
        private_port = self._in.get(key)
        if private_port is None or packet[12:16] + packet[l4 : l4 + 2] not in self._peers[key]:
            self.dropped += 1
            return None
        out = bytearray(packet)
        _rewrite(out, 16, l4 + 2, self.private, private_port, checksum_at)
        return bytes(out)

    def _map(self, proto: int, private_port: bytes) -> bytes:
        public_port = self._out.get((proto, private_port))
        if public_port is None:
            candidate = int.from_bytes(private_port, "big")
            while (proto, candidate.to_bytes(2, "big")) in self._in:
                candidate = candidate + 1 if candidate < 65535 else _FIRST_PORT
            public_port = candidate.to_bytes(2, "big")
            self._out[proto, private_port] = public_port
            self._in[proto, public_port] = private_port
            self._peers[proto, public_port] = set()
        return public_port


@dataclass
class Link:
    """One direction between two hosts: its configuration and its queue's state."""

    delay_s: float = 0.0
    bytes_s: float | None = None  # None: unlimited
    buffer_bytes: float = float("inf")
    busy_until: float = 0.0  # when the last queued packet finishes leaving
    last_arrival: float = 0.0

    def configure(self, delay_s: float, bandwidth_bits_s: float | None) -> None:
        self.delay_s = delay_s
        self.bytes_s = None if bandwidth_bits_s is None else bandwidth_bits_s / 8
        self.buffer_bytes = (
            float("inf") if self.bytes_s is None else max(_MIN_BUFFER_BYTES, self.bytes_s * _BUFFER_S)
        )

    def arrival(self, now: float, size: int) -> float | None:
        """When a packet of ``size`` bytes sent now arrives, or None when the queue is full (dropped)."""
        if self.bytes_s is None:
            departure = now
        else:
            start = max(now, self.busy_until)
            if (start - now) * self.bytes_s + size > self.buffer_bytes:
                return None
            departure = self.busy_until = start + size / self.bytes_s
        arrival = self.last_arrival = max(departure + self.delay_s, self.last_arrival)
        return arrival


class Router:
    def __init__(self, config: dict[str, Any]) -> None:
        hosts = config["hosts"]
        self.fds: list[int] = [h["fd"] for h in hosts]
        self.names: list[str] = [h["name"] for h in hosts]
        # destination address -> host index; a NATed host is reached only through its public address
        self.by_address: dict[bytes, int] = {socket.inet_aton(h["public"]): i for i, h in enumerate(hosts)}
        self.nats: list[Masquerade | None] = [
            Masquerade.of(h["address"], h["public"]) if h["address"] != h["public"] else None for h in hosts
        ]
        self.links = [[Link() for _ in hosts] for _ in hosts]
        self.set_all(config["link"])
        self.queue: list[tuple[float, int, int, bytes]] = []  # (arrival, sequence, destination fd, packet)
        self.sequence = itertools.count()
        self.counts = {"forwarded": 0, "dropped_unknown": 0, "dropped_queue": 0, "dropped_nat": 0}

    def set_all(self, spec: dict[str, Any]) -> None:
        for row in self.links:
            for link in row:
                link.configure(spec["delay_s"], spec["bandwidth_bits_s"])

    def set_link(self, src: int, dst: int, spec: dict[str, Any]) -> None:
        self.links[src][dst].configure(spec["delay_s"], spec["bandwidth_bits_s"])

    def _through_nat(self, host: int, packet: bytes, outbound: bool) -> bytes | None:
        """``packet`` as ``host``'s NAT passes it, out of its home network or into it; None if dropped."""
        nat = self.nats[host]
        if nat is None:
            return packet
        passed = nat.outbound(packet) if outbound else nat.inbound(packet)
        if passed is None:
            self.counts["dropped_nat"] += 1
        return passed

    def receive(self, src: int, packet: bytes, now: float) -> None:
        """Route one packet read from host ``src``'s TUN."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return  # not IPv4 (the kernel's IPv6 chatter): nobody here listens to it
        masqueraded = self._through_nat(src, packet, outbound=True)
        if masqueraded is None:
            return
        dst = self.by_address.get(masqueraded[16:20])
        if dst is None or dst == src:
            self.counts["dropped_unknown"] += 1
            return
        admitted = self._through_nat(dst, masqueraded, outbound=False)
        if admitted is None:
            return
        packet = admitted
        arrival = self.links[src][dst].arrival(now, len(packet))
        if arrival is None:
            self.counts["dropped_queue"] += 1
        elif arrival <= now:
            self.deliver(self.fds[dst], packet)
        else:
            heapq.heappush(self.queue, (arrival, next(self.sequence), self.fds[dst], packet))

    def deliver(self, fd: int, packet: bytes) -> None:
        try:
            os.write(fd, packet)
            self.counts["forwarded"] += 1
        except OSError:  # the namespace's stack refused it (e.g. its device went down): a lost packet
            self.counts["dropped_queue"] += 1

    def control(self, line: str) -> dict[str, Any]:
        try:
            return self._control(json.loads(line))
        except (ValueError, KeyError, TypeError) as error:
            return {"ok": False, "error": f"{error!r} in request {line!r}"}

    def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        if "set" in request:
            s = request["set"]
            if s.get("src") is None:
                self.set_all(s["link"])
            else:
                self.set_link(self.names.index(s["src"]), self.names.index(s["dst"]), s["link"])
            return {"ok": True}
        if "stats" in request:
            return {"ok": True, **self.counts}
        return {"ok": False, "error": "unknown request"}

    def run(self) -> None:
        # select(2) takes its timeout in microseconds; epoll's millisecond one would add up to 1 ms per hop
        selector = selectors.SelectSelector()
        for i, fd in enumerate(self.fds):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, i)
        control = sys.stdin.fileno()
        selector.register(control, selectors.EVENT_READ, -1)
        pending = b""
        print(json.dumps({"ready": True}), flush=True)
        queue, fds, receive, deliver = self.queue, self.fds, self.receive, self.deliver
        # A timed wake comes a fraction of a millisecond late: wake that much early, by a running mean of how late
        # the timed wakes were, so a hop's delay is what was configured rather than a bit more.
        lead = 0.0
        while True:
            timeout = max(0.0, queue[0][0] - time.monotonic() - lead) if queue else None
            asleep_at = time.monotonic()
            events = selector.select(timeout)
            if not events and timeout:
                late = time.monotonic() - asleep_at - timeout
                lead += _LEAD_WEIGHT * (min(max(late, 0.0), _MAX_LEAD_S) - lead)
            for key, _ in events:
                src = key.data
                if src < 0:
                    chunk = os.read(control, 65536)
                    if not chunk:
                        return  # the network's owner is gone
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        print(json.dumps(self.control(line.decode())), flush=True)
                    continue
                fd = fds[src]
                while True:
                    try:
                        packet = os.read(fd, _READ_BYTES)
                    except BlockingIOError:
                        break
                    receive(src, packet, time.monotonic())
            due = time.monotonic() + lead
            while queue and queue[0][0] <= due:
                _, _, fd, packet = heapq.heappop(queue)
                deliver(fd, packet)


def main() -> None:
    # ahead of the peers' compute on a shared machine: a link's delay should not wait for a busy core
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, _NICENESS)
    Router(json.loads(sys.argv[1])).run()


if __name__ == "__main__":
    main()
