"""Which of this host's addresses another host can reach it on (chapter 12; docs/multinode.md).

A rendezvous *store* (torch's `TCPStore`) listens on every address of its host, so a peer that dials
`MASTER_ADDR` or `kv_ip` finds it. The gloo process groups built over that store are different:
each rank opens its own listening socket and writes into the store the address peers should dial,
and gloo picks that address by resolving the host's *name*. Many machines map their name to a
loopback address in /etc/hosts (Debian's `127.0.1.1`, containers' `127.0.0.1`): a rank then
advertises 127.0.0.1, and a rank on another host that dials it reaches itself, not the rank.

The cure is to say which address to use: the one this host's traffic to the rendezvous host leaves
from. The kernel's routing table knows it — `connect()` on a UDP socket picks the route and source
address without sending a packet — so no configuration is needed when the rendezvous address is
right. `GLOO_SOCKET_IFNAME` (gloo's own variable), when set, wins.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct

import torch.distributed as dist

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def address_towards(host: str, port: int = 9) -> str:
    """The local address that traffic from this host to `host` leaves from (no packet is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` ("lo", "eth0", ...), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def gloo_interface_towards(host: str, port: int) -> str | None:
    """Point the process's default gloo group at the interface that reaches `host` (sets
    `GLOO_SOCKET_IFNAME` before `init_process_group` reads it); the interface used, or None when
    the variable was set already or no interface holds the address (gloo then resolves the host name)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    name = interface_with_address(address_towards(host, port))
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def gloo_group_towards(store: dist.Store, rank: int, size: int, host: str, port: int,
                       timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A private gloo group whose rank listens on, and advertises, the address that reaches `host`
    (or on `GLOO_SOCKET_IFNAME`'s interface when that is set)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        device = dist.ProcessGroupGloo.create_default_device()
    else:
        device = dist.ProcessGroupGloo.create_device(hostname=address_towards(host, port))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)
