"""Listen addresses as values (devd.server.listeners): parsed once, written back the same, bound and closed."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from devd.addresses import TcpListen, UnixListen, address
from devd.server.listeners import ActivatedListen, bind, made_up_token, origin


def test_addresses_parse_to_their_kind_and_write_back_as_clients_address_them() -> None:
    texts = ["tcp://127.0.0.1:7411", "tcp://[::1]:7411", "unix:/run/devd.sock", "/run/devd.sock"]
    parsed = [address(text) for text in texts]
    assert (parsed, [str(a) for a in parsed]) == (
        [TcpListen("127.0.0.1", 7411), TcpListen("::1", 7411), *[UnixListen(Path("/run/devd.sock"))] * 2],
        ["tcp://127.0.0.1:7411", "tcp://[::1]:7411", "unix:/run/devd.sock", "unix:/run/devd.sock"],
    )


def test_a_tcp_address_that_is_not_host_and_port_is_refused_in_listen_s_words() -> None:
    with pytest.raises(ValueError) as e:
        TcpListen.parse("tcp://localhost")
    assert str(e.value) == "--listen takes tcp://HOST:PORT, not 'tcp://localhost'"


def test_the_peer_rule_is_the_token_on_tcp_and_the_uid_on_unix() -> None:
    assert [TcpListen("::1", 1).needs_token, UnixListen(Path("x")).needs_token] == [True, False]


def test_canonical_addresses_compare_equal_when_they_reach_the_same_socket() -> None:
    assert (
        address("unix:/run/a/../devd.sock").canonical() == address("/run/devd.sock").canonical(),
        address("tcp://LOCALHOST:1").canonical() == address("tcp://localhost:1").canonical(),
    ) == (True, True)


def test_a_bound_unix_socket_is_served_as_its_path_and_removed_at_close(tmp_path: Path) -> None:
    path = tmp_path / "run" / "devd.sock"
    listening = bind(UnixListen(path))
    served, existed = listening.served, path.exists()
    listening.close()
    assert (served, existed, path.exists()) == (UnixListen(path), True, False)


def test_a_tcp_port_0_is_served_as_the_port_given() -> None:
    listening = bind(TcpListen("127.0.0.1", 0))
    try:
        served = listening.served
    finally:
        listening.close()
    assert (served.host, served.port != 0) == ("127.0.0.1", True)


def test_an_activated_socket_is_served_as_what_its_family_makes_it_and_left_in_place(tmp_path: Path) -> None:
    path = tmp_path / "activated.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    listening = bind(ActivatedListen(sock, "rpc"))
    served = listening.served
    listening.close()
    assert (served, path.exists()) == (UnixListen(path), True)


def test_an_activated_abstract_unix_socket_is_served_as_its_name() -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(f"\0devd-test-{os.getpid()}")
        served = bind(ActivatedListen(sock, "rpc")).served
    assert served == UnixListen(Path(f"\0devd-test-{os.getpid()}"))


def test_a_made_up_token_never_starts_with_a_dash_which_a_command_line_takes_for_a_flag() -> None:
    # One token in 64 started so; of 2,000 tokens, none does.
    assert [t for t in (made_up_token() for _ in range(2000)) if t.startswith("-") or len(t) != 43] == []


def test_a_unix_peer_is_named_by_its_uid_and_pid() -> None:
    one, two = socket.socketpair(socket.AF_UNIX)
    with one, two:
        assert origin(one) == f"uid {os.getuid()}, pid {os.getpid()}"


def test_a_tcp_peer_is_named_by_its_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            assert origin(accepted) == f"127.0.0.1:{client.getsockname()[1]}"
