"""Measure an emulated link with plain sockets, run inside a host's namespace as a script (no project imports):

    python probe.py serve HOST PORT            # TCP echo/sink server and UDP echo; prints {"ready": true}
    python probe.py rtt HOST PORT COUNT        # {"rtt_s": [...]}: TCP round trips of 64 bytes
    python probe.py bulk HOST PORT BYTES       # {"bits_s": ...}: bulk TCP rate seen by the receiver
    python probe.py connect HOST PORT TIMEOUT  # {"ok": bool, "error": str}: can a TCP connection be opened
    python probe.py udp HOST PORT TIMEOUT      # {"ok": bool}: does a UDP datagram come back

The bulk rate is the receiver's, over the bytes after the first quarter (TCP's start is not the link's rate).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

_ECHO, _SINK = b"e", b"s"
_PING_BYTES = 64


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed early")
        data += chunk
    return data


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = _recv_exactly(conn, 1)
        if mode == _ECHO:
            while ping := conn.recv(_PING_BYTES):
                conn.sendall(ping)
            return
        total = int.from_bytes(_recv_exactly(conn, 8), "big")
        warm, got, warm_at = total // 4, 0, 0.0
        buffer = bytearray(1 << 20)
        while got < total:
            n = conn.recv_into(buffer)
            if not n:
                raise ConnectionError("closed early")
            if got < warm <= got + n:
                warm_at, warm_got = time.monotonic(), got + n
            got += n
        seconds = time.monotonic() - warm_at
        conn.sendall(json.dumps({"bits_s": (total - warm_got) * 8 / seconds}).encode())


def serve(host: str, port: int) -> None:
    listener = socket.create_server((host, port))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, port))

    def echo_udp() -> None:
        while True:
            data, sender = udp.recvfrom(2048)
            udp.sendto(data, sender)

    threading.Thread(target=echo_udp, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def rtt(host: str, port: int, count: int) -> dict[str, object]:
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_ECHO)
        times = []
        for _ in range(count):
            start = time.monotonic()
            sock.sendall(b"x" * _PING_BYTES)
            _recv_exactly(sock, _PING_BYTES)
            times.append(time.monotonic() - start)
    return {"rtt_s": times}


def bulk(host: str, port: int, total: int) -> dict[str, object]:
    with socket.create_connection((host, port), timeout=120) as sock:
        sock.sendall(_SINK + total.to_bytes(8, "big"))
        block, sent = b"\0" * (1 << 20), 0
        while sent < total:
            n = min(len(block), total - sent)
            sock.sendall(block[:n])
            sent += n
        answer: dict[str, object] = json.loads(sock.recv(4096))
    return answer


def connect(host: str, port: int, timeout_s: float) -> dict[str, object]:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return {"ok": True, "error": ""}
    except OSError as error:
        return {"ok": False, "error": repr(error)}


def udp(host: str, port: int, timeout_s: float) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        sock.sendto(b"probe", (host, port))
        try:
            return {"ok": sock.recv(2048) == b"probe"}
        except OSError:
            return {"ok": False}


def main(argv: list[str]) -> None:
    command, host, port = argv[0], argv[1], int(argv[2])
    if command == "serve":
        serve(host, port)
        return
    arg = argv[3]
    commands = {
        "rtt": lambda: rtt(host, port, int(arg)),
        "bulk": lambda: bulk(host, port, int(arg)),
        "connect": lambda: connect(host, port, float(arg)),
        "udp": lambda: udp(host, port, float(arg)),
    }
    print(json.dumps(commands[command]()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
