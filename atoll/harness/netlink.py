"""A WAN link that TCP believes: kernel rate shaping, and delay and loss on the packets themselves.

The proxy in :mod:`atoll.harness.wan` ends each TCP connection and opens another, so the islands' TCP
never sees the link's round trip or its bottleneck. Here the islands' own packets cross the link:

- each site is a network namespace of its own; the coordinator's side is the namespace the caller
  runs in (``unshare -rn`` makes one, with root inside it: :func:`enter_namespace`);
- the two are joined by a pair of TUN devices, one in each namespace (``site`` has address
  ``10.77.K.2``, the coordinator's side ``10.77.K.1``), and a **delay line** between them: a process
  that reads each packet a namespace sends, holds it for half the round trip, drops it with
  probability ``loss``, and writes it into the other namespace (:func:`delay_line`);
- the rate is the kernel's: a ``tbf`` qdisc on each TUN device's egress, with a queue of one
  bandwidth-delay product (``queue_ms`` of it), so the bottleneck queues and drops as a router's would.
  This kernel has ``tbf`` and ``htb`` but no ``netem``: delay and loss live in the delay line.

The TUN devices carry jumbo packets (``mtu``, 9000 by default): the delay line is Python, and at
1 Gbit/s 9000-byte packets are 14k a second each way where 1500-byte ones would be 83k (a core's
worth). TCP sees the same round trip and rate either way; its segments are larger.

Both sides' TCP buffers are raised to 4x the bandwidth-delay product (``tcp_rmem``/``tcp_wmem`` of each
namespace), as a host tuned for bulk transfers over the link would have them, unless
``tuned_buffers=False`` (the kernel's defaults: one stream then fills no more than its send buffer).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
EMULATION = "network namespaces + TUN delay line + kernel tbf"


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    rate_mbit: float
    """Each direction's rate (the tbf qdisc on each side's egress)."""
    rtt_ms: float
    """The round trip the delay line adds (half each way); the namespaces' own is microseconds."""
    loss: float = 0.0
    """Probability that the delay line drops a packet, each direction."""
    queue_ms: float | None = None
    """The bottleneck queue, in ms of the rate (None: one round trip, at least 5 ms)."""
    mtu: int = 9000
    tuned_buffers: bool = True
    """Raise both namespaces' TCP buffer limits to 4x the bandwidth-delay product, as a host tuned for
    bulk transfers over the link would (False: the kernel's defaults, tcp_wmem's 4 MiB)."""
    slow_start_after_idle: bool = True
    """The kernel's default: a connection idle for a retransmission timeout starts from its initial
    window again. False: both hosts keep the window they had (``net.ipv4.tcp_slow_start_after_idle=0``,
    a usual setting on hosts that move bulk data over long links), which kept connections then use."""

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0 or self.rtt_ms < 0 or not 0 <= self.loss < 1 or not 576 <= self.mtu <= 65000:
            raise ValueError("need rate_mbit > 0, rtt_ms >= 0, 0 <= loss < 1 and 576 <= mtu <= 65000")

    @property
    def bdp_bytes(self) -> int:
        return int(self.rate_mbit * 1e6 / 8 * self.rtt_ms / 1e3)


OWN_NAMESPACE = "ATOLL_OWN_NETNS"
"""Set (to "1") in a process that :func:`enter_namespace` started in a network namespace of its own."""


def can_emulate() -> str | None:
    """None when this process can build links (in a network namespace of its own, with TUN and tc),
    else why not. Links change the namespace's devices and TCP limits: never the machine's own."""
    for tool in ("ip", "tc", "nsenter", "unshare", "sysctl"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    if os.environ.get(OWN_NAMESPACE) != "1":
        return "not in a network namespace of its own (start it with enter_namespace: `unshare -rn`)"
    return None


def enter_namespace(argv: list[str]) -> None:
    """Re-run this program (``argv``) under ``unshare -rn`` unless it runs in one already: a network
    namespace of its own (root inside it), where links can be built without touching the machine's
    network, even when the caller is root on the machine."""
    if os.environ.get(OWN_NAMESPACE) == "1":
        return
    os.execvpe("unshare", ["unshare", "-rn", sys.executable, *argv], {**os.environ, OWN_NAMESPACE: "1"})


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when the process that made the link dies, however it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _sh(*cmd: str, netns_pid: int | None = None) -> None:
    full = (["nsenter", "-t", str(netns_pid), "-n", "--"] if netns_pid else []) + list(cmd)
    out = subprocess.run(full, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {out.stderr.strip()}")


class Link:
    """One site joined to the caller's namespace by an emulated link (a context manager).

    ``site_command(argv)`` runs a command in the site's namespace; ``coordinator_host`` is the
    caller's address as the site sees it, ``site_host`` the site's. Everything it starts (the
    namespace's holder, the delay line) stops on exit, and the namespace and devices go with them."""

    def __init__(self, spec: LinkSpec, index: int = 0) -> None:
        if not 0 <= index < 250:
            raise ValueError("index must be in [0, 250)")
        self.spec = spec
        self.index = index
        self.coordinator_host = f"10.77.{index}.1"
        self.site_host = f"10.77.{index}.2"
        self._near, self._far = f"wan{index}c", f"wan{index}s"
        self._holder: subprocess.Popen | None = None
        self._line: subprocess.Popen | None = None

    @property
    def netns_pid(self) -> int:
        if self._holder is None:
            raise RuntimeError("the link is not up")
        return self._holder.pid

    def site_command(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.netns_pid), "-n", "--", *argv]

    def __enter__(self) -> Link:
        why = can_emulate()
        if why is not None:
            raise RuntimeError(f"cannot emulate a WAN link here: {why}")
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _up(self) -> None:
        spec = self.spec
        self._holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"], preexec_fn=_die_with_parent)
        line_args = [
            sys.executable, "-m", "atoll.harness.netlink", "--delay-line", self._near, self._far,
            str(spec.rtt_ms / 2e3), str(spec.loss),
        ]  # fmt: skip
        self._line = subprocess.Popen(line_args, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        if self._line.stdout.readline().strip() != "ready":
            raise RuntimeError("the delay line did not start")
        _sh("ip", "link", "set", self._far, "netns", str(self._holder.pid))
        queue_ms = spec.queue_ms if spec.queue_ms is not None else max(spec.rtt_ms, 5.0)
        limit = max(int(spec.rate_mbit * 1e6 / 8 * queue_ms / 1e3), 4 * spec.mtu)
        burst = max(2 * spec.mtu, int(spec.rate_mbit * 1e6 / 8 / 1000))  # a ms of the rate, two packets at least
        buffers = max(4 * spec.bdp_bytes, 4 << 20)
        for dev, me, peer, pid in (
            (self._near, self.coordinator_host, self.site_host, None),
            (self._far, self.site_host, self.coordinator_host, self._holder.pid),
        ):
            _sh("ip", "link", "set", "lo", "up", netns_pid=pid)
            _sh("ip", "link", "set", dev, "mtu", str(spec.mtu), "up", netns_pid=pid)
            _sh("ip", "addr", "add", me, "peer", peer, "dev", dev, netns_pid=pid)
            _sh(
                "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{spec.rate_mbit}mbit",
                "burst", str(burst), "limit", str(limit), netns_pid=pid,
            )  # fmt: skip
            for name in ("tcp_rmem", "tcp_wmem") if spec.tuned_buffers else ():
                _sh("sysctl", "-q", "-w", f"net.ipv4.{name}=4096 131072 {buffers}", netns_pid=pid)
            if not spec.slow_start_after_idle:
                _sh("sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0", netns_pid=pid)

    def close(self) -> None:
        for proc in (self._line, self._holder):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._line is not None and self._line.stdout is not None:
            self._line.stdout.close()
        self._line = self._holder = None


# ---- the delay line (its own process) ------------------------------------------------------------------
def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def delay_line(near: str, far: str, one_way_s: float, loss: float) -> None:
    """Carry packets between TUN devices ``near`` and ``far`` (made here), each ``one_way_s`` late,
    each dropped with probability ``loss``. Packets leave in the order they came, each direction."""
    a, b = _tun(near), _tun(far)
    peer = {a: b, b: a}
    held: dict[int, collections.deque] = {a: collections.deque(), b: collections.deque()}
    poller = select.epoll()
    for fd in (a, b):
        poller.register(fd, select.EPOLLIN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    rand, clock = random.random, time.monotonic
    while True:
        due = min((q[0][0] for q in held.values() if q), default=None)
        timeout = -1 if due is None else max(due - clock(), 0.0)
        for fd, _ in poller.poll(timeout):
            queue = held[fd]
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if loss and rand() < loss:
                    continue
                queue.append((clock() + one_way_s, packet))
        now = clock()
        for fd, queue in held.items():
            out = peer[fd]
            while queue and queue[0][0] <= now:
                with contextlib.suppress(OSError):  # the far side's device went down: the packet is lost
                    os.write(out, queue.popleft()[1])


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--delay-line":
        delay_line(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))
    else:
        sys.exit("usage: python -m atoll.harness.netlink --delay-line NEAR FAR ONE_WAY_SECONDS LOSS")
