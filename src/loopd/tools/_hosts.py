"""Which hosts the web reaches through loopd (`fetch_url`, and commands through `_proxy`): the
domain lists that `[tools.fetch]` and `[tools.run] network` name, and the address actually
connected to.

A pattern is a name (`example.com`: that name alone), `*.example.com` (any name under it, not
`example.com` itself, as Claude Code's sandbox and Codex's proxy match), an IP address, or a
network (`10.0.0.0/8`). The deny list wins over the allow list.

Addresses that are not the internet's (loopback, private, link-local with the clouds' metadata
service at 169.254.169.254, shared, unique-local `fd00::/8`, multicast, unspecified) are
refused unless the allow list names that address or a network holding it. A name never opens
one, even an allowed name: whoever controls a domain's DNS decides where it points. The name is
resolved once, each address is checked, and the connection is made to an address that passed,
so the same name cannot resolve anew to another one in between (DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

__all__ = [
    "Address",
    "HostRefused",
    "HostRules",
    "Resolver",
    "connect",
    "special",
    "system_resolver",
]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[Address]]]
"""A host's addresses, in the order to try them (`system_resolver`; tests give their own)."""


class HostRefused(Exception):
    """The host or every address it has is refused; the message says why, for the model."""


async def system_resolver(host: str, port: int) -> list[Address]:
    """The machine's own resolution (`getaddrinfo`), each address once, in its order."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: dict[Address, None] = {}
    for *_, sockaddr in infos:
        found[ipaddress.ip_address(sockaddr[0])] = None
    return list(found)


def _unmapped(address: Address) -> Address:
    """An IPv4 address written as IPv6 (`::ffff:127.0.0.1`) is that IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def special(address: Address) -> bool:
    """Whether `address` is not one of the internet's (loopback, private, link-local, ...)."""
    address = _unmapped(address)
    return not address.is_global or address.is_multicast


def host_of(host: str) -> str:
    """A host as patterns are matched against it: lowercase, no final dot, no brackets."""
    return host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def _literal(host: str) -> Address | None:
    try:
        return _unmapped(ipaddress.ip_address(host))
    except ValueError:
        return None


def _network(pattern: str) -> Network | None:
    try:
        return ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        return None


@dataclass(frozen=True)
class HostRules:
    allow: Sequence[str] = ()
    deny: Sequence[str] = ()
    allow_key: str = "[tools.fetch] allow"
    deny_key: str = "[tools.fetch] deny"
    """The keys that name the lists, for the messages."""

    def denied(self, host: str) -> bool:
        return _names(self.deny, host_of(host))

    def allowed(self, host: str) -> bool:
        """Whether the allow list names `host` (the deny list aside)."""
        return _names(self.allow, host_of(host))

    def address_refusal(self, host: str, address: Address) -> str | None:
        """Why `host` may not be reached at `address` (None: it may)."""
        address = _unmapped(address)
        shown = host_of(host)
        via = "" if _literal(shown) == address else f" (which {shown} resolves to)"
        if _holds(self.deny, address):
            return f"{address}{via} is on {self.deny_key}"
        if special(address) and not _holds(self.allow, address):
            return (
                f"{address}{via} is a {_kind(address)} address, refused unless "
                f"{self.allow_key} names it (the address, or a network holding it)"
            )
        return None


def _names(patterns: Sequence[str], host: str) -> bool:
    address = _literal(host)
    if address is not None:
        return _holds(patterns, address)
    for pattern in patterns:
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]):
                return True
        elif pattern == host:
            return True
    return False


def _holds(patterns: Sequence[str], address: Address) -> bool:
    """Whether an address or a network among `patterns` holds `address`."""
    for pattern in patterns:
        network = _network(pattern)
        if network is not None and network.version == address.version and address in network:
            return True
    return False


def _kind(address: Address) -> str:
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_private:
        return "private"
    return "special-purpose"


async def connect(
    rules: HostRules, host: str, port: int, resolve: Resolver = system_resolver
) -> trio.SocketStream:
    """A connection to `host`'s first address that the rules let through and that answers.
    Raises `HostRefused` when none may be reached, `OSError` when none answers."""
    host = host_of(host)
    literal = _literal(host)
    try:
        addresses = [literal] if literal is not None else await resolve(host, port)
    except OSError as e:
        raise OSError(f"{host} could not be resolved: {e}") from e
    refusals, failure = [], None
    for address in addresses:
        if why := rules.address_refusal(host, address):
            refusals.append(why)
            continue
        try:
            return await trio.open_tcp_stream(str(address), port)
        except OSError as e:
            failure = e
    if failure is not None:
        raise OSError(f"{host} port {port} did not answer: {failure}") from failure
    if refusals:
        raise HostRefused(refusals[0])
    raise OSError(f"{host} has no address")
