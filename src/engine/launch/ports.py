"""The port where the processes of a one-machine run meet, when the user names none.

Lightning's MASTER_PORT is an ephemeral port, unbound until rank 0's store listens: the kernel may meanwhile hand it
to an outgoing connection ("Address already in use"). A free port below the ephemeral range is never handed out so."""

import os
import secrets
import socket
from pathlib import Path

from engine.errors import UserError

LOWEST = 20000  # below: ports that services tend to use


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(address: str, tries: int = 50) -> int:
    """A port that `address` can listen on now, chosen at random below the ephemeral range; the kernel's choice
    where that range leaves no room below it."""
    start, family = ephemeral_start(), socket.AF_INET6 if ":" in address else socket.AF_INET
    for _ in range(tries if start > LOWEST + 1000 else 0):
        port = LOWEST + secrets.randbelow(start - LOWEST)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
        return port
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def check_master_port(address: str, listen: bool) -> int:
    """MASTER_PORT as the user set it, checked before any other rank starts (`listen`: that rank 0 can listen on it
    now): a rank started before rank 0 found its port taken would be left waiting for it."""
    value = os.environ["MASTER_PORT"]
    if not (value.strip().isdigit() and 1 <= int(value) <= 65535):
        raise UserError(
            f"MASTER_PORT={value!r} is not a port number (1-65535): give one, or unset MASTER_PORT and a free port "
            "is chosen"
        )
    if listen:
        from engine.strategies.rendezvous import listen_on

        os.close(listen_on(address, int(value))[0])
    return int(value)
