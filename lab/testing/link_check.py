"""Measure the link between two simulated hosts with a real TCP transfer (checks that a cap holds)."""
from __future__ import annotations

import subprocess
import sys

_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); got = 0; start = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if start is None:
        start = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - start, flush=True)
"""

_SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(chunk)
c.close()
"""


def measure_gbit(sender_ns: str, receiver_ns: str, receiver_addr: str, megabytes: int, timeout: float = 60.0) -> float:
    """Gbit/s of one TCP stream of ``megabytes`` MiB from a host to another, timed by the receiver
    from its first byte to the end (so the connection's start-up is not counted)."""
    receiver = subprocess.Popen(["ip", "netns", "exec", receiver_ns, sys.executable, "-c", _RECEIVER, receiver_addr],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()  # type: ignore[union-attr]
        subprocess.run(["ip", "netns", "exec", sender_ns, sys.executable, "-c", _SENDER, receiver_addr, port,
                        str(megabytes)], check=True, timeout=timeout)
        out, _ = receiver.communicate(timeout=timeout)
        got, seconds = out.split()
        return int(got) * 8 / float(seconds) / 1e9
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
