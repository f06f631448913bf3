"""Hosts in network namespaces joined by the userspace delay line (``router.py``): see ``EmulatedNet``."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_HOST_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
_MAX_DEVICE_NAME = 15
_CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}  # devices and addresses; mounting a namespace
PROBE = Path(__file__).with_name("probe.py")  # socket measurements run inside a namespace (probe.py)


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: one-way delay in seconds and bandwidth in bits/s (None: unlimited)."""

    delay_s: float = 0.0
    bandwidth_bits_s: float | None = None

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.bandwidth_bits_s is not None and self.bandwidth_bits_s <= 0:
            raise ValueError(f"bandwidth_bits_s must be > 0 or None, got {self.bandwidth_bits_s}")


def namespaces_unavailable() -> str | None:
    """Why network namespaces with TUN devices cannot be made here (for a pytest skip), or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [name for name, bit in _CAPABILITIES.items() if not _effective_capabilities() >> bit & 1]
    if missing:
        return f"root without {' and '.join(missing)} (a restricted container?)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "no /dev/net/tun to open"
    return None


def _effective_capabilities() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class EmulatedNet:
    """One network namespace per host (``<prefix>-<host>``), each with a TUN device ``<prefix><i>`` and one
    address in 10.77.0.0/16, joined by one router process that applies a ``LinkSpec`` per ordered pair.

        with EmulatedNet("fsn", ["p1", "p2"], LinkSpec(0.025, 100e6)) as net:
            server = net.popen("p1", [sys.executable, "-m", "http.server", "--bind", net.address("p1")])
            net.set_link("p1", "p2", LinkSpec(0.050, 20e6))  # live: one direction, from now on

    A host in ``nat_hosts`` sits behind a home router of its own: it has a private address (``address``) that
    nobody else can route to, its outbound TCP/UDP leaves from ``public_address`` and only replies get back in.
    Traffic never leaves the namespaces: they have no route but 10.77.0.0/16 through the router, which drops
    what is not for one of its hosts. ``close`` (also at exit) stops the router and deletes the namespaces.
    """

    def __init__(
        self,
        prefix: str,
        hosts: Sequence[str],
        link: LinkSpec = LinkSpec(),
        nat_hosts: Sequence[str] = (),
        mtu: int = 65000,
    ) -> None:
        reason = namespaces_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot emulate a network here: {reason}")
        if len(set(hosts)) != len(hosts) or not 0 < len(hosts) < 250:
            raise ValueError(f"hosts must be 1..249 distinct names, got {list(hosts)}")
        for host in hosts:
            if not _HOST_NAME.fullmatch(host):
                raise ValueError(f"host name {host!r}: lower-case letters, digits, '-' and '_'")
        if len(f"{prefix}{len(hosts) - 1}") > _MAX_DEVICE_NAME:
            raise ValueError(f"prefix {prefix!r} too long for device names of {_MAX_DEVICE_NAME} characters")
        unknown = set(nat_hosts) - set(hosts)
        if unknown:
            raise ValueError(f"nat_hosts not among hosts: {sorted(unknown)}")
        self.prefix, self.hosts, self.nat_hosts = prefix, list(hosts), set(nat_hosts)
        self.link, self.mtu = link, mtu
        self._router: subprocess.Popen[str] | None = None
        self._made: list[str] = []
        atexit.register(self.close)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """The host's own address, to bind to (private for a host behind a NAT)."""
        i = self.hosts.index(host)
        return f"10.77.{1 if host in self.nat_hosts else 0}.{i + 1}"

    def public_address(self, host: str) -> str:
        """Where others reach the host: its own address, or its NAT's public address."""
        i = self.hosts.index(host)
        return f"10.77.{2 if host in self.nat_hosts else 0}.{i + 1}"

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host's namespace."""
        return ["ip", "netns", "exec", self.namespace(self._known(host)), *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.exec_argv(host, argv), **kwargs)

    def probe(self, host: str, *args: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """Run ``probe.py ARGS`` inside ``host``'s namespace and return its JSON answer (see probe.py)."""
        done = subprocess.run(
            self.exec_argv(host, [sys.executable, str(PROBE), *args]),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"probe {' '.join(args)} in {host} failed: {done.stderr[-2000:]}")
        answer: dict[str, Any] = json.loads(done.stdout)
        return answer

    @contextlib.contextmanager
    def probe_server(self, host: str, port: int) -> Iterator[str]:
        """A probe server (TCP echo and sink, UDP echo) on ``host``'s address and ``port``; yields the address."""
        server = self.popen(
            host, [sys.executable, str(PROBE), "serve", self.address(host), str(port)], stdout=subprocess.PIPE
        )
        try:
            assert server.stdout is not None
            if not server.stdout.readline():
                raise RuntimeError(f"the probe server in {host} did not start")
            yield self.address(host)
        finally:
            server.kill()
            server.wait(timeout=10)
            if server.stdout is not None:
                server.stdout.close()

    def set_link(self, src: str, dst: str, spec: LinkSpec) -> None:
        """Change the direction src -> dst from now on (packets already queued keep their times)."""
        self._control({"set": {"src": self._known(src), "dst": self._known(dst), "link": asdict(spec)}})

    def set_all(self, spec: LinkSpec) -> None:
        """Change every direction between every two hosts."""
        self._control({"set": {"src": None, "link": asdict(spec)}})

    def stats(self) -> dict[str, int]:
        """The router's counts: forwarded, dropped_unknown (no such host), dropped_queue (buffer full),
        dropped_nat (refused by a NAT)."""
        answer = self._control({"stats": True})
        return {k: v for k, v in answer.items() if k != "ok"}

    def router_cpu_s(self) -> float:
        """CPU seconds (user + system) the router process has used so far."""
        if self._router is None:
            return 0.0
        fields = open(f"/proc/{self._router.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Stop the router (its TUN devices go with it) and delete the namespaces; safe to call twice."""
        router, self._router = self._router, None
        if router is not None:
            with contextlib.suppress(OSError):
                assert router.stdin is not None
                router.stdin.close()  # the router exits when its control pipe closes
            try:
                router.wait(timeout=5)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(timeout=5)
            with contextlib.suppress(OSError):
                assert router.stdout is not None
                router.stdout.close()
        made, self._made = self._made, []
        for namespace in made:
            with contextlib.suppress(RuntimeError):
                _ip("netns", "delete", namespace)
        atexit.unregister(self.close)

    def __enter__(self) -> EmulatedNet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _known(self, host: str) -> str:
        if host not in self.hosts:
            raise KeyError(f"no host {host!r} in this network (hosts: {self.hosts})")
        return host

    def _start(self) -> None:
        existing = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        fds: list[int] = []
        try:
            for i, host in enumerate(self.hosts):
                namespace, device = self.namespace(host), f"{self.prefix}{i}"
                if namespace in existing:  # left behind by a run that was killed: ours by its name
                    _ip("netns", "delete", namespace)
                _ip("netns", "add", namespace)
                self._made.append(namespace)
                fds.append(_open_tun(device))
                _ip("link", "set", device, "netns", namespace)
                _ip("-n", namespace, "link", "set", "lo", "up")
                _ip("-n", namespace, "link", "set", device, "mtu", str(self.mtu), "up")
                _ip("-n", namespace, "addr", "add", f"{self.address(host)}/16", "dev", device)
            config = {
                "hosts": [
                    {"name": h, "fd": fd, "address": self.address(h), "public": self.public_address(h)}
                    for h, fd in zip(self.hosts, fds, strict=True)
                ],
                "link": asdict(self.link),
            }
            self._router = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("router.py")), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                pass_fds=fds,
            )
            if not json.loads(self._readline()).get("ready"):
                raise RuntimeError("the router did not start")
        finally:
            for fd in fds:  # the router holds them now; a TUN device goes away with its last fd
                os.close(fd)

    def _readline(self) -> str:
        assert self._router is not None and self._router.stdout is not None
        line = self._router.stdout.readline()
        if not line:
            raise RuntimeError(f"the router exited with {self._router.poll()}")
        return line

    def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._router is None:
            raise RuntimeError("this network is closed")
        stdin: IO[str] | None = self._router.stdin
        assert stdin is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        answer: dict[str, Any] = json.loads(self._readline())
        if not answer.get("ok"):
            raise RuntimeError(f"router: {answer.get('error')}")
        return answer


def _open_tun(device: str) -> int:
    """A new TUN device (IPv4 packets without a header) in this namespace, and the fd that keeps it alive."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", device.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd
