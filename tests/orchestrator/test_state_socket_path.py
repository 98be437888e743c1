"""The leader's state socket binds wherever its own path fits: the private name it binds first is no
longer than the socket's (a Unix socket's path has at most 107 bytes; deep run directories near it)."""

from __future__ import annotations

import socket

from orchestrator.leadership import _bind_state_socket


def test_a_state_socket_path_of_the_longest_length_binds(tmp_path):
    directory = tmp_path / ("d" * max(1, 107 - len(str(tmp_path)) - len("/state.sock") - 1))
    directory.mkdir()
    path = directory / "state.sock"
    assert len(str(path)) <= 107
    server = _bind_state_socket(path)
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        client.close()
        assert [p.name for p in directory.iterdir()] == ["state.sock"]
    finally:
        server.close()
