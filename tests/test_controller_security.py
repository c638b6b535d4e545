"""When the controller leaves loopback, security stays on: it listens only on the address asked
for, messages stay signed with a non-empty key, and the connection files are the owner's alone."""
from __future__ import annotations

import ipaddress
import json
import socket
import stat
import warnings
from pathlib import Path

import psutil
import pytest

import lab
from tests.launcher_checks import rank_sum
from tests.test_pool_loopback import LOOPBACK, listening


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def public_ports(connection: dict) -> set[int]:
    """The controller ports a connection file hands to engines or clients."""
    ports = set()
    for value in connection.values():
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            ports.add(value)
        elif isinstance(value, list):
            ports |= {v for v in value if isinstance(v, int)}
    return ports


@pytest.mark.slow
def test_a_controller_off_loopback_binds_only_there_signs_messages_and_hides_its_files():
    address = outside_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to put the controller on")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        pool = lab.start(2, controller_ip=address, spare_engines=0, activate=False)
    try:
        assert pool.run(rank_sum) == [1.0, 1.0]
        source = pool._source
        controller_pid = source.ipp_cluster.controller.pid
        controller = psutil.Process(controller_pid)
        controller_family = {controller_pid, *(p.pid for p in controller.children(recursive=True))}
        sockets = listening(pool.pids)
        controller_sockets = {(ip, port) for pid, ip, port in sockets if pid in controller_family}
        # Engines and clients reach the controller on the address asked for; its processes talk among
        # themselves on loopback (ipyparallel's internal channels); nothing listens on every interface.
        assert {ip for ip, _ in controller_sockets} == {address, "127.0.0.1"}, sorted(controller_sockets)
        assert {ip for _, ip, _ in sockets} <= {address} | LOOPBACK, sorted(sockets)

        assert source.client.session.key and source.client.session.signature_scheme == "hmac-sha256"
        security = Path(source.profile_dir) / "security"
        connection_files = sorted(security.glob("ipcontroller-*.json"))
        assert len(connection_files) == 2, connection_files  # the client's and the engines'
        for path in connection_files:
            connection = json.loads(path.read_text())
            assert connection["key"] and connection["signature_scheme"] == "hmac-sha256", path.name
            assert connection["interface"] == f"tcp://{address}", path.name
            for port in public_ports(connection):
                assert {ip for ip, p in controller_sockets if p == port} == {address}, (path.name, port)
        for path in security.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"
        assert stat.S_IMODE(Path(source.profile_dir).stat().st_mode) & 0o077 == 0
    finally:
        pool.stop()
