"""Loaded by the test server's Python (PYTHONPATH): refuse and record every non-loopback connection.

Active when QWEN_EDIT_NETGUARD_LOG names a file; each refused attempt appends
one line ``<kind> <destination>`` there, so a test can prove that loading and
sampling never touched the network.
"""

import os
import socket

_LOG = os.environ.get("QWEN_EDIT_NETGUARD_LOG")
_LOOPBACK = ("127.", "::1", "localhost", "0.0.0.0")


def _local(host) -> bool:
    return host is None or str(host).startswith(_LOOPBACK) or str(host) == ""


def _refuse(kind: str, destination) -> None:
    with open(_LOG, "a") as log:
        log.write(f"{kind} {destination!r}\n")
    raise OSError(f"network access blocked by the test guard: {kind} {destination!r}")


if _LOG:
    _connect = socket.socket.connect
    _connect_ex = socket.socket.connect_ex
    _getaddrinfo = socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            _refuse("connect", address)
        return _connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            _refuse("connect_ex", address)
        return _connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _local(host):
            _refuse("getaddrinfo", host)
        return _getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.getaddrinfo = getaddrinfo
