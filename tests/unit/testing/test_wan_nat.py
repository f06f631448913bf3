"""The emulated NAT's packet rewriting (swarm/testing/wan/router.py): checksums stay valid, replies map back,
and nothing gets in that was not asked for."""

from __future__ import annotations

import socket
import struct

import pytest

from swarm.testing.wan.router import TCP, UDP, Masquerade, checksum_adjust, internet_checksum

PRIVATE, PUBLIC, REMOTE = "10.77.1.2", "10.77.2.2", "10.77.0.1"


def packet(proto: int, src: str, sport: int, dst: str, dport: int, payload: bytes = b"hello!") -> bytes:
    """An IPv4 TCP or UDP packet with correct checksums."""
    if proto == TCP:
        l4 = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, 0x02, 65535, 0, 0) + payload
        at = 16
    else:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
        at = 6
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, proto, len(l4))
    l4 = l4[:at] + internet_checksum(pseudo + l4).to_bytes(2, "big") + l4[at + 2 :]
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0x4000, 64, proto, 0,
                         socket.inet_aton(src), socket.inet_aton(dst))  # fmt: skip
    header = header[:10] + internet_checksum(header).to_bytes(2, "big") + header[12:]
    return header + l4


def checksums_valid(data: bytes | bytearray) -> bool:
    data = bytes(data)
    proto, l4 = data[9], data[20:]
    pseudo = data[12:20] + struct.pack("!BBH", 0, proto, len(l4))
    return internet_checksum(data[:20]) == 0 and internet_checksum(pseudo + l4) == 0


def ends(data: bytes | bytearray) -> tuple[str, int, str, int]:
    src, dst = socket.inet_ntoa(bytes(data[12:16])), socket.inet_ntoa(bytes(data[16:20]))
    sport, dport = struct.unpack("!HH", bytes(data[20:24]))
    return src, sport, dst, dport


def test_checksum_adjust_equals_a_full_recompute() -> None:
    data = bytes(range(40))
    changed = data[:10] + b"\xab\xcd\xef\x01" + data[14:]
    assert checksum_adjust(internet_checksum(data), data[10:14], b"\xab\xcd\xef\x01") == internet_checksum(
        changed
    )


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_outbound_leaves_from_the_public_address_and_replies_come_back(proto: int) -> None:
    nat = Masquerade.of(PRIVATE, PUBLIC)
    out = nat.outbound(packet(proto, PRIVATE, 40000, REMOTE, 7000))
    assert out is not None and checksums_valid(out)
    assert ends(out) == (PUBLIC, 40000, REMOTE, 7000)  # the port is kept while it is free
    back = nat.inbound(packet(proto, REMOTE, 7000, PUBLIC, 40000))
    assert back is not None and checksums_valid(back)
    assert ends(back) == (REMOTE, 7000, PRIVATE, 40000)


def test_a_taken_public_port_maps_to_the_next() -> None:
    nat = Masquerade.of(PRIVATE, PUBLIC)
    first = nat.outbound(packet(TCP, PRIVATE, 1024, REMOTE, 7000))
    assert first is not None and ends(first)[1] == 1024
    # public port 2000 held by another mapping: private port 2000 leaves from the next free one
    nat._in[TCP, (2000).to_bytes(2, "big")] = (1).to_bytes(2, "big")
    moved = nat.outbound(packet(TCP, PRIVATE, 2000, REMOTE, 7000))
    assert moved is not None and ends(moved)[1] == 2001 and checksums_valid(moved)


def test_nothing_gets_in_unasked() -> None:
    nat = Masquerade.of(PRIVATE, PUBLIC)
    assert nat.inbound(packet(TCP, REMOTE, 7000, PUBLIC, 40000)) is None  # no mapping: no connection in
    assert nat.outbound(packet(TCP, PRIVATE, 40000, REMOTE, 7000)) is not None
    assert nat.inbound(packet(TCP, REMOTE, 7001, PUBLIC, 40000)) is None  # another port of the same host
    assert nat.inbound(packet(TCP, "10.77.0.9", 7000, PUBLIC, 40000)) is None  # another host
    assert nat.inbound(packet(UDP, REMOTE, 7000, PUBLIC, 40000)) is None  # the TCP mapping is not UDP's
    assert nat.dropped == 4


def test_a_udp_datagram_without_checksum_keeps_none() -> None:
    nat = Masquerade.of(PRIVATE, PUBLIC)
    raw = bytearray(packet(UDP, PRIVATE, 5000, REMOTE, 7000))
    raw[26:28] = b"\0\0"
    out = nat.outbound(bytes(raw))
    assert out is not None and out[26:28] == b"\0\0" and internet_checksum(bytes(out[:20])) == 0


def test_other_protocols_and_fragments_are_dropped() -> None:
    nat = Masquerade.of(PRIVATE, PUBLIC)
    icmp = bytearray(packet(UDP, PRIVATE, 5000, REMOTE, 7000))
    icmp[9] = 1
    fragment = bytearray(packet(UDP, PRIVATE, 5000, REMOTE, 7000))
    fragment[6:8] = b"\x20\x00"  # more fragments follow
    spoofed = packet(TCP, "10.77.1.99", 5000, REMOTE, 7000)  # not the host behind this NAT
    assert nat.outbound(bytes(icmp)) is None
    assert nat.outbound(bytes(fragment)) is None
    assert nat.outbound(spoofed) is None
