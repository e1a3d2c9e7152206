"""Browse: which addresses it may reach (devd/agent/addresses.py, pure, with resolvers handed in), the tool itself
against real page servers on loopback addresses (refusals, browse_private, every redirect hop checked, at most 5
redirects, the checked address connected to, and the page's text), and the profile's key through the real daemon."""

from __future__ import annotations

import gzip
import ipaddress
import socket
import tracemalloc
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import msgspec
import pytest

from devd.agent import addresses, tools
from devd.agent.addresses import Unreachable, check, kind, public_only
from devd.agent.profiles import Profile
from devd.agent.tools import Result, browse
from tests.agents import SECRET, agents_toml, run_turn
from tests.harness import InProcess
from tests.standin_model import Scripted, Served, Standin, serve_page, standin_fixture  # noqa: F401 (the fixture)

REFUSAL = "Browse reaches only public addresses unless the agent's profile allows private ones"


class Pages(Served):
    """A page server on one loopback address. `pages` maps a path to its text, to bytes (served as a PNG), or to
    `redirect:LOCATION`; `encoded` a path to (Content-Encoding, body), a text page sent so; `hosts` holds the Host
    header of each request, in order; `encodings` the Accept-Encoding of each."""

    def __init__(self, address: str) -> None:
        self.pages: dict[str, str | bytes] = {}
        self.encoded: dict[str, tuple[str, bytes]] = {}
        self.hosts: list[str] = []
        self.encodings: list[str | None] = []
        pages = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                pages._serve(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

        super().__init__(address, Handler, "pages")
        self.origin = f"http://{address}:{self.port}"

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        self.hosts.append(h.headers.get("Host", ""))
        self.encodings.append(h.headers.get("Accept-Encoding"))
        if h.path in self.encoded:
            encoding, body = self.encoded[h.path]
            h.send_response(200)
            h.send_header("Content-Type", "text/plain; charset=utf-8")
            h.send_header("Content-Encoding", encoding)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        serve_page(h, self.pages)


@pytest.fixture
def pages() -> Iterator[Pages]:
    """A page server on 127.0.0.1."""
    with Pages("127.0.0.1") as server:
        yield server


@pytest.fixture
def other() -> Iterator[Pages]:
    """A page server on 127.0.0.2: loopback too, so a policy can allow it and not 127.0.0.1."""
    with Pages("127.0.0.2") as server:
        yield server


def profile(**fields: Any) -> Profile:
    base: dict[str, Any] = {"name": "coder", "base_url": "http://h/v1", "model": "m", "workspace_roots": ("/",)}
    return Profile(**(base | fields))


def only_127_0_0_2(address: addresses.Address) -> str | None:
    """A policy allowing 127.0.0.2 and nothing else that is not public."""
    return None if address == ipaddress.ip_address("127.0.0.2") else kind(address)


def resolver(answers: Mapping[str, Sequence[str]]) -> addresses.Resolver:
    """A resolver that knows only `answers`, and an IP address as itself."""

    def resolve(host: str, port: int) -> Sequence[str]:
        if host in answers:
            return answers[host]
        try:
            return [str(ipaddress.ip_address(host))]
        except ValueError:
            raise OSError(f"{host} is not in this test's resolver") from None

    return resolve


def refusal(host: str, answers: Sequence[str]) -> str:
    with pytest.raises(Unreachable) as e:
        check(host, 80, resolver({host: answers}), public_only)
    return e.value.why


# -- which addresses (pure) ---------------------------------------------------------------------------------------


def test_a_public_name_that_resolves_to_loopback_is_refused_naming_the_address() -> None:
    assert refusal("docs.example.com", ["127.0.0.1"]) == "docs.example.com resolves to 127.0.0.1, a loopback address"


def test_an_ipv4_mapped_loopback_address_is_refused_as_loopback() -> None:
    assert refusal("::ffff:127.0.0.1", ["::ffff:127.0.0.1"]) == (
        "::ffff:127.0.0.1 is a loopback address (IPv4 127.0.0.1, mapped into IPv6)"
    )


def test_a_name_with_a_public_and_a_private_address_is_refused() -> None:
    assert refusal("rebind.example.com", ["93.184.216.34", "10.0.0.5"]) == (
        "rebind.example.com resolves to 10.0.0.5, a private address (RFC 1918)"
    )


def test_a_name_that_does_not_resolve_is_unreachable_but_not_refused_as_private() -> None:
    with pytest.raises(Unreachable) as e:
        check("nowhere.example.com", 80, resolver({}), public_only)
    assert (e.value.why, e.value.private) == (
        "nowhere.example.com does not resolve (nowhere.example.com is not in this test's resolver)",
        False,
    )


def test_a_name_whose_addresses_are_all_public_gives_them_in_order() -> None:
    answers = ["2606:2800:220:1:248:1893:25c8:1946", "93.184.216.34"]
    assert check("example.com", 443, resolver({"example.com": answers}), public_only) == [
        ipaddress.ip_address(a) for a in answers
    ]


def test_every_kind_of_address_that_is_not_public_is_named() -> None:
    examples = [
        "169.254.169.254",
        "0.0.0.0",
        "::",
        "0.1.2.3",
        "127.0.0.2",
        "::1",
        "169.254.1.1",
        "fe80::1",
        "224.0.0.251",
        "ff02::1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "fd00::1",
        "100.64.0.1",
        "255.255.255.255",
        "240.0.0.1",
        "::ffff:10.0.0.1",
        "64:ff9b::a9fe:a9fe",
        "192.0.2.1",
        "2001:db8::1",
    ]
    assert {a: kind(ipaddress.ip_address(a)) for a in examples} == {
        "169.254.169.254": "the cloud metadata address",
        "0.0.0.0": "the unspecified address (it reaches this machine)",
        "::": "the unspecified address (it reaches this machine)",
        "0.1.2.3": "an address of 'this network' (0.0.0.0/8)",
        "127.0.0.2": "a loopback address",
        "::1": "a loopback address",
        "169.254.1.1": "a link-local address",
        "fe80::1": "a link-local address",
        "224.0.0.251": "a multicast address",
        "ff02::1": "a multicast address",
        "10.1.2.3": "a private address (RFC 1918)",
        "172.16.0.1": "a private address (RFC 1918)",
        "192.168.1.1": "a private address (RFC 1918)",
        "fd00::1": "a unique local address (fc00::/7, IPv6's private range)",
        "100.64.0.1": "a shared address (100.64.0.0/10, carrier-grade NAT)",
        "255.255.255.255": "the broadcast address",
        "240.0.0.1": "a reserved address (240.0.0.0/4)",
        "::ffff:10.0.0.1": "a private address (RFC 1918) (IPv4 10.0.0.1, mapped into IPv6)",
        "64:ff9b::a9fe:a9fe": "the cloud metadata address (IPv4 169.254.169.254, through NAT64)",
        "192.0.2.1": "a special-purpose address, not a public one",
        "2001:db8::1": "a special-purpose address, not a public one",
    }


def test_a_6to4_or_teredo_address_carrying_a_private_ipv4_one_is_refused_as_that_address() -> None:
    """2002:7f00:1:: passed as public (an independent attack): a 6to4 relay delivers it to 127.0.0.1."""
    examples = ["2002:7f00:1::", "2002:a00:1::", "2001:0:808:808::f5ff:fffe", "2002:808:808::"]
    assert {a: kind(ipaddress.ip_address(a)) for a in examples} == {
        "2002:7f00:1::": "a loopback address (IPv4 127.0.0.1, carried by 6to4)",
        "2002:a00:1::": "a private address (RFC 1918) (IPv4 10.0.0.1, carried by 6to4)",
        "2001:0:808:808::f5ff:fffe": "a private address (RFC 1918) (IPv4 10.0.0.1, the Teredo client)",
        "2002:808:808::": None,
    }


def test_public_addresses_are_allowed_however_they_are_written() -> None:
    public = ["8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]
    assert [kind(ipaddress.ip_address(a)) for a in public] == [None, None, None, None]


# -- the tool, against real servers -------------------------------------------------------------------------------


async def test_browse_of_a_loopback_url_is_refused_by_default_saying_how_to_allow_it(pages: Pages) -> None:
    pages.pages["/admin"] = "the admin page"
    url = pages.origin + "/admin"
    assert (await browse(url, profile()), pages.hosts) == (
        Result(
            f"refused to fetch {url}: 127.0.0.1 is a loopback address; {REFUSAL} "
            "(browse_private = true in [agent.coder])",
            True,
        ),
        [],
    )


async def test_browse_of_a_loopback_url_is_allowed_with_browse_private(pages: Pages) -> None:
    pages.pages["/admin"] = "the admin page"
    assert await browse(pages.origin + "/admin", profile(browse_private=True)) == Result("the admin page")


async def test_a_name_resolving_to_loopback_is_refused_before_anything_is_sent(pages: Pages) -> None:
    url = f"http://docs.example.com:{pages.port}/"
    result = await browse(url, profile(), resolve=resolver({"docs.example.com": ["127.0.0.1"]}))
    assert (result, pages.hosts) == (
        Result(
            f"refused to fetch {url}: docs.example.com resolves to 127.0.0.1, a loopback address; {REFUSAL} "
            "(browse_private = true in [agent.coder])",
            True,
        ),
        [],
    )


async def test_a_redirect_from_an_allowed_address_to_a_refused_one_is_refused(pages: Pages, other: Pages) -> None:
    other.pages["/moved"] = f"redirect:{pages.origin}/admin"
    pages.pages["/admin"] = "the admin page"
    result = await browse(other.origin + "/moved", profile(), policy=only_127_0_0_2)
    assert (result, pages.hosts) == (
        Result(
            f"refused to follow the redirect from {other.origin}/moved to {pages.origin}/admin: 127.0.0.1 is a "
            f"loopback address; {REFUSAL} (browse_private = true in [agent.coder])",
            True,
        ),
        [],
    )


async def test_browse_connects_to_the_address_it_checked_and_sends_the_name(other: Pages) -> None:
    """The name is known only to the resolver handed in: had Browse resolved it again to connect, it would fail."""
    other.pages["/"] = "a page"
    url = f"http://pages.test:{other.port}/"
    result = await browse(url, profile(), policy=only_127_0_0_2, resolve=resolver({"pages.test": ["127.0.0.2"]}))
    assert (result, other.hosts) == (Result("a page"), [f"pages.test:{other.port}"])


async def test_browse_tries_the_next_checked_address_when_one_does_not_connect(other: Pages) -> None:
    other.pages["/"] = "a page"
    answers = {"pages.test": ["127.0.0.3", "127.0.0.2"]}  # nothing listens on 127.0.0.3
    url = f"http://pages.test:{other.port}/"
    assert await browse(url, profile(browse_private=True), resolve=resolver(answers)) == Result("a page")


async def test_browse_follows_five_redirects(pages: Pages) -> None:
    pages.pages |= {f"/r{i}": f"redirect:/r{i + 1}" for i in range(5)} | {"/r5": "the end"}
    assert await browse(pages.origin + "/r0", profile(browse_private=True)) == Result("the end")


async def test_browse_refuses_a_sixth_redirect_saying_it_follows_at_most_five(pages: Pages) -> None:
    pages.pages |= {f"/r{i}": f"redirect:/r{i + 1}" for i in range(6)} | {"/r6": "the end"}
    result = await browse(pages.origin + "/r0", profile(browse_private=True))
    assert (result, len(pages.hosts)) == (
        Result(
            f"cannot fetch {pages.origin}/r0: it redirects more than 5 times (the next, from {pages.origin}/r5, to "
            f"{pages.origin}/r6); Browse follows at most 5: browse {pages.origin}/r6 itself if it is the page you "
            "want",
            True,
        ),
        6,
    )


async def test_a_redirect_to_a_url_that_is_not_http_is_refused(pages: Pages) -> None:
    pages.pages["/away"] = "redirect:file:///etc/passwd"
    result = await browse(pages.origin + "/away", profile(browse_private=True))
    assert result == Result(
        f"refused to follow the redirect from {pages.origin}/away to 'file:///etc/passwd': "
        "it is not an http:// or https:// URL",
        True,
    )


async def test_a_name_that_does_not_resolve_fails_without_mentioning_browse_private() -> None:
    url = "http://nowhere.example.com/"
    assert await browse(url, profile(), resolve=resolver({})) == Result(
        f"cannot fetch {url}: nowhere.example.com does not resolve (nowhere.example.com is not in this test's "
        "resolver)",
        True,
    )


async def test_a_name_the_resolver_cannot_encode_fails_saying_why() -> None:
    url = "http://docs..example.com/"
    assert await browse(url, profile()) == Result(
        f"cannot fetch {url}: docs..example.com is not a name that can be resolved (a part of it is empty or longer "
        "than 63 characters)",
        True,
    )


async def test_a_name_that_is_not_valid_idna_is_looked_up_as_written() -> None:
    url = "http://xn--zz.example.com/"
    assert await browse(url, profile(), resolve=resolver({})) == Result(
        f"cannot fetch {url}: xn--zz.example.com does not resolve (xn--zz.example.com is not in this test's resolver)",
        True,
    )


async def test_a_server_that_never_answers_fails_the_call_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "BROWSE_DEADLINE_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts the connection; nothing answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        assert await browse(url, profile(browse_private=True)) == Result(
            f"cannot fetch {url}: no answer within 0.5 s (its lookups, connections, redirects and reads in all); "
            "try again later, or another address",
            True,
        )


async def test_browse_gets_the_page_text_capped(pages: Pages) -> None:
    pages.pages["/docs"] = "0123456789"
    result = await browse(pages.origin + "/docs", profile(browse_private=True, output_bytes_max=4))
    assert result == Result("0123\n[cut: the page is longer than 4 bytes; the rest was not read]")


async def test_browse_follows_a_relative_redirect(pages: Pages) -> None:
    pages.pages |= {"/old": "redirect:/new", "/new": "moved here"}
    assert await browse(pages.origin + "/old", profile(browse_private=True)) == Result("moved here")


async def test_browse_of_an_image_fails_saying_it_is_not_text(pages: Pages) -> None:
    pages.pages["/logo"] = b"\x89PNG\r\n"
    url = pages.origin + "/logo"
    assert await browse(url, profile(browse_private=True)) == Result(
        f"{url} is image/png, not text; it is not shown", True
    )


async def test_browse_of_a_missing_page_fails_with_its_status(pages: Pages) -> None:
    result = await browse(pages.origin + "/none", profile(browse_private=True))
    assert result == Result(f"GET {pages.origin}/none: HTTP 404\nno page /none", True, why="HTTP 404")


async def test_a_gzip_bomb_page_is_refused_unread_and_identity_was_asked_for(pages: Pages) -> None:
    pages.encoded["/bomb"] = ("gzip, gzip", gzip.compress(gzip.compress(b"A" * (32 << 20), 9), 9))
    tracemalloc.start()
    try:
        result = await browse(pages.origin + "/bomb", profile(browse_private=True))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (result, pages.encodings, peak < 4 << 20) == (
        Result(
            f"cannot fetch {pages.origin}/bomb: the server sent its answer in content encoding 'gzip, gzip', which "
            "devd does not decode (it asks for identity: a compressed body can inflate past every bound); make the "
            "server answer uncompressed",
            True,
        ),
        ["identity"],
        True,
    )


async def test_browse_of_a_url_that_is_not_http_fails_saying_so() -> None:
    assert await browse("file:///etc/passwd", profile()) == Result(
        "cannot fetch 'file:///etc/passwd': it is not an http:// or https:// URL", True
    )


# -- through the daemon -------------------------------------------------------------------------------------------


def browsed(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, **keys: str) -> list[Any]:
    """The model asks to browse the stand-in's own /docs page (on 127.0.0.1) through a real daemon whose profile
    lists browse, with `keys` added; the Tool messages of the session's conversation."""
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", tools='["browse"]', **keys))
    standin.pages["/docs"] = "the docs"
    url = standin.url.removesuffix("/v1") + "/docs"
    standin.script(Scripted(tool_calls=[("browse", {"url": url})]), Scripted(text="read"))
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon, daemon.client() as c:
        session = c.new(agent="coder", workspace=tmp_path / "roots" / "ws")
        run_turn(c, session, "read the docs")
        messages = msgspec.to_builtins(c.transcript(session))
    return [(m["Tool"]["text"], m["Tool"].get("failed", False)) for m in messages if "Tool" in m]


def test_the_daemon_refuses_a_loopback_page_to_a_profile_without_browse_private(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = standin.url.removesuffix("/v1") + "/docs"
    assert browsed(tmp_path, standin, monkeypatch) == [
        (
            f"refused to fetch {url}: 127.0.0.1 is a loopback address; {REFUSAL} "
            "(browse_private = true in [agent.coder])",
            True,
        )
    ]


def test_the_daemon_reads_a_loopback_page_for_a_profile_with_browse_private(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert browsed(tmp_path, standin, monkeypatch, browse_private="true") == [("the docs", False)]
