"""The wires of simulated hosts: network namespaces on one bridge, and a capped link between them.

Each host is a Linux network namespace holding one end of a veth pair (renamed ``eth0``);
the other end is a port of a bridge in the root namespace, which holds the bridge address
(``.1``) where the controller listens. Hosts are ``.11``, ``.12`` ... of one /24.

A capped link is an HTB class on each host's ``eth0`` that only traffic to another host's
address enters (traffic to the controller and to the host itself stays unshaped); without
HTB in the kernel, a TBF on the whole ``eth0`` (the controller's traffic then shares the cap).

Every name carries a token made from this process id, so two sessions never share one,
and :meth:`Network.leftovers` can tell what of this network still exists. Needs root.
"""
from __future__ import annotations

import ipaddress
import re
import os
import subprocess
from dataclasses import dataclass, field


class NetworkError(RuntimeError):
    """A step of building the simulated network failed; the message names the command and its error."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (inside ``netns`` when given), raising NetworkError with its stderr on failure."""
    cmd = ["ip", "-n", netns, *args] if netns else ["ip", *args]
    return run(cmd, check=check)


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; on failure with ``check``, a NetworkError naming it and what it said."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        raise NetworkError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface of this machine uses yet."""
    used = ip("-4", "-o", "addr", "show").stdout
    for n in range(os.getpid() % 200, os.getpid() % 200 + 256):
        prefix = f"10.{200 + (n // 256) % 50}.{n % 256}"
        if f" {prefix}." not in used:
            return ipaddress.IPv4Network(f"{prefix}.0/24")
    raise NetworkError("no free 10.x.y.0/24 subnet for the simulated hosts")


@dataclass
class Network:
    """k namespaces ``hosts[i]`` with address ``addresses[i]`` on one bridge; ``shaping`` says how the link is capped."""

    token: str
    subnet: ipaddress.IPv4Network
    hosts: list[str] = field(default_factory=list)  # namespace names, host order
    addresses: list[str] = field(default_factory=list)
    hostnames: list[str] = field(default_factory=list)  # what each host's engines report as their host name
    link_gbit: float | None = None  # the cap asked for between hosts
    shaping: str | None = None  # "htb", "tbf", or None (no cap asked, or none could be set)
    shaping_problem: str = ""  # why a cap that was asked for is not in place
    measured_gbit: float | None = None  # one TCP stream between two hosts, after the cap was set

    @property
    def bridge(self) -> str:
        return f"clb{self.token}"

    @property
    def bridge_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def veth(self, i: int) -> str:
        """The root-namespace end of host i's veth pair (its counters are host i's traffic to the others)."""
        return f"clv{self.token}{i}"

    def build(self, k: int) -> None:
        """Create the bridge and ``k`` namespaces wired onto it (partial state is left for :meth:`remove`)."""
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(k):
            ns, addr, peer = f"clab-{self.token}-h{i}", str(self.subnet.network_address + 11 + i), f"clp{self.token}{i}"
            ip("netns", "add", ns)
            self.hosts.append(ns)
            ip("link", "add", self.veth(i), "type", "veth", "peer", "name", peer)
            ip("link", "set", self.veth(i), "master", self.bridge, "up")
            ip("link", "set", peer, "netns", ns)
            ip("link", "set", peer, "name", "eth0", netns=ns)
            ip("addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0", netns=ns)
            ip("link", "set", "eth0", "up", netns=ns)
            ip("link", "set", "lo", "up", netns=ns)
            self.addresses.append(addr)
            self.hostnames.append(f"host{i}")

    def cap(self, gbit: float) -> None:
        """Cap every host's traffic to the other hosts at ``gbit`` Gbit/s (HTB, else TBF); records ``shaping``."""
        rate = f"{int(gbit * 1e6)}kbit"
        try:
            for i, ns in enumerate(self.hosts):
                self._htb(ns, gbit, [a for j, a in enumerate(self.addresses) if j != i])
            self.shaping = "htb"
            return
        except NetworkError as error:
            htb_problem = str(error)
            for ns in self.hosts:
                run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        try:
            for ns in self.hosts:  # burst: enough for one timer tick at this rate, at least 64 KiB
                burst = max(65536, int(gbit * 1e9 / 8 / 250))
                run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                     "rate", rate, "burst", str(burst), "latency", "50ms"])
            self.shaping = "tbf"
        except NetworkError as error:
            self.shaping_problem = f"htb: {htb_problem}; tbf: {error}"

    @staticmethod
    def _htb(ns: str, gbit: float, peers: list[str]) -> None:
        tc = ["ip", "netns", "exec", ns, "tc"]
        rate = f"{int(gbit * 1e6)}kbit"
        # Burst: 1 ms at the rate, at least 16 KiB. A fixed 256 KiB let a whole TP all-reduce through at full speed
        # whenever compute had left the link idle, so training beat the rate a back-to-back sweep measures.
        burst = str(max(16384, int(gbit * 1e9 / 8 / 1000)))
        run(tc + ["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb"])  # default 0: unclassified bypasses
        run(tc + ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
                  "burst", burst, "cburst", burst])
        for peer in peers:
            run(tc + ["filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                      "match", "ip", "dst", f"{peer}/32", "flowid", "1:10"])

    def count_only(self) -> None:
        """Classify traffic to the other hosts as :meth:`cap` does, at a rate no link here reaches, to count it."""
        try:
            for i, ns in enumerate(self.hosts):
                self._htb(ns, 100.0, [a for j, a in enumerate(self.addresses) if j != i])
        except NetworkError as error:
            self.shaping_problem = f"no inter-host byte counters: {error}"

    def inter_host_bytes(self) -> list[int] | None:
        """Bytes each host has sent to the other hosts so far, headers included (the HTB class's counter); None without HTB."""
        out = []
        for ns in self.hosts:  # this iproute2 prints no JSON for classes: read the text
            shown = run(["ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", "eth0"], check=False).stdout
            found = re.search(r"class htb 1:10 .*\n\s*Sent (\d+) bytes", shown)
            if found is None:
                return None
            out.append(int(found.group(1)))
        return out

    def sent_bytes(self) -> list[int]:
        """Bytes each host has sent out of its namespace so far (its veth's receive counter in the root namespace)."""
        out = []
        for i in range(len(self.hosts)):
            with open(f"/sys/class/net/{self.veth(i)}/statistics/rx_bytes") as f:
                out.append(int(f.read()))
        return out

    def remove(self) -> list[str]:
        """Delete the namespaces, veths and bridge (qdiscs go with their devices); returns what could not be removed."""
        for ns in self.hosts:
            ip("netns", "del", ns, check=False)
        for i in range(len(self.hosts)):
            ip("link", "del", self.veth(i), check=False)
        ip("link", "del", self.bridge, check=False)
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """Namespaces and links with this network's token that still exist."""
        names = ip("netns", "list").stdout.split() + ip("-o", "link", "show").stdout.replace("@", " ").split()
        return sorted({n.rstrip(":") for n in names if self.token in n})


def new_network() -> Network:
    """An empty Network with a fresh token and a free subnet (nothing created yet)."""
    if os.geteuid() != 0:
        raise PermissionError("simulated hosts need root: network namespaces, veth pairs, a bridge and tc "
                              f"all need CAP_NET_ADMIN (running as uid {os.geteuid()})")
    token = f"{os.getpid() % 65536:04x}{_counter()}"
    return Network(token, _free_subnet())


_made = [0]


def _counter() -> str:
    _made[0] += 1
    return f"{_made[0] % 16:x}"
