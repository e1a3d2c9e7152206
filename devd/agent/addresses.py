"""Which addresses Browse may reach, decided without I/O: the resolver is handed in.

Browse runs in the daemon, outside any sandbox, so a URL a model names could otherwise reach what only the daemon's
host should: a local admin service, the daemon's own `/metrics`, a cloud metadata service, the private network.
`public_only` (the default) refuses every address that is not public, and says what kind it is; `anywhere` is what a
profile's `browse_private = true` chooses.

`check` resolves a host once and refuses it unless every address it resolves to is allowed (a name that resolves to
both a public and a private address is how a rebinding attack starts); the caller then connects to those checked
addresses, never resolving the name again, so what is reached is what was checked.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]  # (host, port) -> the addresses it resolves to, as text
Policy = Callable[[Address], str | None]  # why an address may not be reached, or None when it may


class Unreachable(Exception):
    """A host Browse will not reach; `why` names the address and what kind it is (or why the name did not resolve)."""

    def __init__(self, why: str, *, private: bool) -> None:
        super().__init__(why)
        self.why = why
        self.private = private  # refused by the policy (browse_private would allow it), not a name that fails


# Every range that is not the public internet, named for the message: the first that holds an address names it.
# Python's `is_global` is the catch-all after them (the IANA special-purpose registry: documentation, benchmarking,
# protocol assignments), so a range forgotten here is still refused, only named less precisely.
_NOT_PUBLIC: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = (
    (ipaddress.ip_network("169.254.169.254/32"), "the cloud metadata address"),
    (ipaddress.ip_network("0.0.0.0/32"), "the unspecified address (it reaches this machine)"),
    (ipaddress.ip_network("::/128"), "the unspecified address (it reaches this machine)"),
    (ipaddress.ip_network("0.0.0.0/8"), "an address of 'this network' (0.0.0.0/8)"),
    (ipaddress.ip_network("127.0.0.0/8"), "a loopback address"),
    (ipaddress.ip_network("::1/128"), "a loopback address"),
    (ipaddress.ip_network("169.254.0.0/16"), "a link-local address"),
    (ipaddress.ip_network("fe80::/10"), "a link-local address"),
    (ipaddress.ip_network("224.0.0.0/4"), "a multicast address"),
    (ipaddress.ip_network("ff00::/8"), "a multicast address"),
    (ipaddress.ip_network("10.0.0.0/8"), "a private address (RFC 1918)"),
    (ipaddress.ip_network("172.16.0.0/12"), "a private address (RFC 1918)"),
    (ipaddress.ip_network("192.168.0.0/16"), "a private address (RFC 1918)"),
    (ipaddress.ip_network("fc00::/7"), "a unique local address (fc00::/7, IPv6's private range)"),
    (ipaddress.ip_network("100.64.0.0/10"), "a shared address (100.64.0.0/10, carrier-grade NAT)"),
    (ipaddress.ip_network("255.255.255.255/32"), "the broadcast address"),
    (ipaddress.ip_network("240.0.0.0/4"), "a reserved address (240.0.0.0/4)"),
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052's well-known prefix: the last 32 bits are an IPv4 address


def kind(address: Address) -> str | None:
    """What kind of address that is not public `address` is (`a loopback address`), or None when it is public. An
    IPv6 address that carries an IPv4 one is what that IPv4 address is: an IPv4-mapped one (`::ffff:127.0.0.1`),
    since connecting to it reaches the IPv4 address; a NAT64 one (`64:ff9b::7f00:1`), since on an IPv6-only network
    DNS64 gives every IPv4-only site such an address, and refusing the prefix whole would refuse them all. A 6to4
    (2002::/16) or Teredo (2001::/32) address is refused when an IPv4 address it carries is not public (a relay
    delivers it there: `2002:7f00:1::` is 127.0.0.1's), else judged as itself (Teredo's prefix is special-purpose, so
    refused)."""
    if isinstance(address, ipaddress.IPv6Address):
        inner: ipaddress.IPv4Address | None = None
        if address.ipv4_mapped is not None:
            inner, how = address.ipv4_mapped, "mapped into IPv6"
        elif address in _NAT64:
            inner, how = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF), "through NAT64"
        if inner is not None:
            why = kind(inner)
            return None if why is None else f"{why} (IPv4 {inner}, {how})"
        for carried, how in _tunnelled(address):
            if (why := kind(carried)) is not None:
                return f"{why} (IPv4 {carried}, {how})"
    for network, name in _NOT_PUBLIC:
        if address in network:
            return name
    if address.is_reserved:
        return "a reserved address"
    if not address.is_global:
        return "a special-purpose address, not a public one"
    return None


def _tunnelled(address: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    """The IPv4 addresses a 6to4 or Teredo address carries, each with how (the Teredo client's, then its server's)."""
    if address.sixtofour is not None:
        return [(address.sixtofour, "carried by 6to4")]
    if address.teredo is not None:
        server, client = address.teredo
        return [(client, "the Teredo client"), (server, "the Teredo server")]
    return []


def public_only(address: Address) -> str | None:
    """The default policy: only public addresses."""
    return kind(address)


def anywhere(address: Address) -> str | None:
    """`browse_private = true`: every address."""
    return None


def check(host: str, port: int, resolve: Resolver, policy: Policy) -> list[Address]:
    """The addresses `host` resolves to, in the resolver's order, when the policy allows every one of them;
    Unreachable (saying which address, and what kind) when it refuses one, or when the name does not resolve."""
    try:
        found = [ipaddress.ip_address(text) for text in resolve(host, port)]
    except OSError as e:
        raise Unreachable(f"{host} does not resolve ({e.strerror or e})", private=False) from None
    except UnicodeError:  # the resolver's IDNA step refuses a name before any lookup
        parts = "a part of it is empty or longer than 63 characters"
        raise Unreachable(f"{host} is not a name that can be resolved ({parts})", private=False) from None
    if not found:
        raise Unreachable(f"{host} resolves to no address", private=False)
    for address in found:
        if (why := policy(address)) is not None:
            said = f"{host} is {why}" if _literal(host) == address else f"{host} resolves to {address}, {why}"
            raise Unreachable(said, private=True)
    return list(dict.fromkeys(found))


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def resolve(host: str, port: int) -> list[str]:
    """The system resolver, for TCP (blocking: call it from a thread); an IP address given as text is itself."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
