"""Who is asking, and by which name: client addresses, trusted proxies, the Host allowlist.

Pure functions over ASGI values; the middleware in ``_middleware`` applies them.

- :func:`client_address`: the peer's address, or, when the peer is a
  configured trusted proxy, the address that proxy put in
  ``X-Forwarded-For`` (read right to left, skipping trusted hops). A
  trusted proxy that names no client gives ``None``: unknown, never loopback.
  ``X-Forwarded-For`` from any other peer is ignored (anyone can send it).
- :func:`host_allowed`: whether a ``Host`` header names this server
  (DNS rebinding: a page on ``evil.example`` resolved to 127.0.0.1 reaches
  a loopback server with ``Host: evil.example``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

__all__ = [
    "LOOPBACK_HOSTS",
    "Network",
    "client_address",
    "host_allowed",
    "is_loopback",
    "normalize_host",
    "parse_networks",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "[::1]")
"""The names a loopback-bound server answers by default (any port)."""


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:
        text = text[1:text.index("]")]
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a client or bind address; ``localhost`` counts) is a loopback address."""
    if not host:
        return False
    address = _address(host)
    return address.is_loopback if address is not None else host.strip().lower() == "localhost"


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """IP networks from addresses or CIDRs (``127.0.0.1``, ``10.0.0.0/8``, ``::1``); ``ValueError`` names a bad one."""
    out: list[Network] = []
    for entry in entries:
        text = entry.strip().removeprefix("[").replace("]", "")
        try:
            out.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(f"not an IP address or network: {entry!r}") from None
    return tuple(out)


def _trusted(host: str | None, networks: Sequence[Network]) -> bool:
    address = _address(host) if host else None
    return address is not None and any(address in net for net in networks)


def client_address(peer: str | None, forwarded_for: Sequence[bytes],
                   trusted: Sequence[Network]) -> str | None:
    """The client's address: ``peer``, or the first untrusted hop of ``X-Forwarded-For`` from the right.

    ``forwarded_for``: every ``X-Forwarded-For`` header value, in order.
    Only a peer inside ``trusted`` is believed; when every hop is trusted the
    leftmost one is the client. ``None`` when a trusted peer names nobody or
    an entry is not an address (unknown: treated as remote).
    """
    if not _trusted(peer, trusted):
        return peer
    hops = [h.strip() for value in forwarded_for
            for h in value.decode("latin-1").split(",") if h.strip()]
    if not hops:
        return None
    for hop in reversed(hops):
        if _address(hop) is None:
            return None
        if not _trusted(hop, trusted):
            return hop
    return hops[0]


def normalize_host(entry: str) -> str:
    """An allowlist entry in the form :func:`host_allowed` compares (lower case, IPv6 in brackets)."""
    text = entry.strip().lower()
    if text != "*" and ":" in text and not text.startswith("["):
        address = _address(text)
        if address is not None and address.version == 6:
            return f"[{address.compressed}]"
    return text


def _split_host(value: str) -> tuple[str, str | None]:
    """``Host`` header → (name, port or ``None``)."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value, None
        rest = value[end + 1:]
        return value[: end + 1], rest[1:] if rest.startswith(":") else None
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit():
        return name, port
    return value, None


def host_allowed(header: bytes | None, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header value matches ``allowed`` (normalized entries; ``name`` or ``name:port``).

    An entry without a port matches the name on any port; a missing or
    malformed header matches nothing.
    """
    if header is None:
        return False
    try:
        value = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return False
    if not value or any(c in value for c in " /\\@?#"):
        return False
    name, port = _split_host(value)
    if name.startswith("[") and name.endswith("]"):
        address = _address(name)
        if address is not None:
            name = f"[{address.compressed}]"
    full = f"{name}:{port}" if port is not None else name
    return name in allowed or full in allowed
