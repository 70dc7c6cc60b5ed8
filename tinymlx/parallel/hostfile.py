"""Hostfiles: which machines run the ranks, in the JSON format `mlx.launch` reads.

    [{"ssh": "mac-studio.local", "ips": ["192.168.1.10"]},     <- rank 0: this machine, the driver
     {"ssh": "macbook.local",    "ips": ["192.168.1.11"]}]     <- rank 1: started over ssh

or {"backend": "ring", "envs": ["KEY=value", ...], "hosts": [...]}. "ips" are the addresses the ranks
use to talk to each other (a Thunderbolt bridge's, for two Macs); "ssh" is how to reach the host.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

LOCAL_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Host:
    ssh: str
    ips: tuple[str, ...]

    @property
    def is_local(self) -> bool:
        return self.ssh in LOCAL_HOSTS


@dataclass(frozen=True)
class Hostfile:
    hosts: tuple[Host, ...]
    envs: tuple[str, ...] = ()

    @property
    def num_ranks_here(self) -> int:
        """Ranks on this machine: rank 0 and the local workers (they share its cores)."""
        return 1 + sum(h.is_local for h in self.hosts[1:])

    @classmethod
    def local(cls, size: int) -> Hostfile:
        """Every rank on this machine, over loopback."""
        return cls(tuple(Host("127.0.0.1", ("127.0.0.1",)) for _ in range(size)))


def read_hostfile(path: str | Path) -> Hostfile:
    """Parse and check a hostfile; raise ValueError naming the file and what is wrong with it."""
    path = Path(path).expanduser()

    def bad(reason: str) -> ValueError:
        return ValueError(f"hostfile {path}: {reason}")

    if not path.is_file():
        raise bad("no such file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad(f"not valid JSON ({error})") from None
    envs: list = []
    if isinstance(data, dict):
        if data.get("backend", "ring") != "ring":
            raise bad(f"backend {data['backend']!r} is not supported; tinymlx runs MLX's ring backend")
        envs = data.get("envs", [])
        if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
            raise bad('"envs" must be a list of "KEY=value" strings')
        data = data.get("hosts")
    if not isinstance(data, list) or not data:
        raise bad('expected a non-empty list of hosts, or an object with a "hosts" list')
    hosts = []
    for rank, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh"), str) or not entry["ssh"]:
            raise bad(f'host {rank} needs an "ssh" name, e.g. {{"ssh": "mac2.local", "ips": ["192.168.1.11"]}}')
        ips = entry.get("ips")
        if not isinstance(ips, list) or not ips:
            raise bad(f'host {rank} ({entry["ssh"]}) needs "ips": the ring backend connects ranks by IP address')
        for ip in ips:
            try:
                if not isinstance(ipaddress.ip_address(ip), ipaddress.IPv4Address):
                    raise ValueError
            except ValueError:
                raise bad(f"host {rank} ({entry['ssh']}): {ip!r} is not an IPv4 address") from None
        hosts.append(Host(entry["ssh"], tuple(ips)))
    if len({len(h.ips) for h in hosts}) > 1:
        raise bad("every host must list the same number of ips (one ring connection per ip)")
    return Hostfile(tuple(hosts), tuple(envs))
