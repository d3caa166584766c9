"""The exec subresource of the fake Kubernetes API: ``pods/{name}/exec`` over a websocket.

The official client's ``kubernetes.stream.stream`` opens
``GET /api/v1/namespaces/{ns}/pods/{pod}/exec?command=…&stdout=True&stderr=True`` as a
websocket, offering the ``v5.channel.k8s.io`` and ``v4.channel.k8s.io`` subprotocols. This fake
speaks v4, as an API server that predates v5 does: every binary message is one channel byte
(1 stdout, 2 stderr, 3 the exit ``Status``) followed by data; the server closes the connection
when the command has ended. The websocket handshake and framing are the ``websockets`` library's
(its Sans-I/O :class:`~websockets.server.ServerProtocol`), not written here.

What runs "in the container" is the test's: :meth:`FakeKube.on_exec` names a function
``(namespace, pod, command) -> ExecResult``; without one, exec answers the ``Status`` of a
container without that executable (exit 126), as a real pod whose image lacks it does.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.datastructures import Headers
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

__all__ = ["V4_CHANNEL", "ExecHandler", "ExecResult", "serve_exec"]

V4_CHANNEL = Subprotocol("v4.channel.k8s.io")
_STDOUT, _STDERR, _ERROR = 1, 2, 3


@dataclass(frozen=True)
class ExecResult:
    """What a command in the fake container printed, and its exit code."""

    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int = 0


ExecHandler = Callable[[str, str, Sequence[str]], ExecResult]


def _status(exit_code: int) -> bytes:
    """The ``Status`` the API server sends on channel 3 when the command has ended."""
    if exit_code == 0:
        return json.dumps({"metadata": {}, "status": "Success"}).encode()
    return json.dumps({
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: exit status {exit_code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(exit_code)}]},
    }).encode()  # fmt: skip


def serve_exec(
    connection: socket.socket,
    path: str,
    headers: Sequence[tuple[str, str]],
    namespace: str,
    pod: str,
    command: Sequence[str],
    run: ExecHandler | None,
) -> None:
    """Answer one exec websocket on ``connection`` (the request line and headers already read)
    and close it. ``run`` gives the command's output; the whole output is sent, then the exit
    ``Status``, then the close handshake."""
    protocol = ServerProtocol(subprotocols=[V4_CHANNEL])
    response = protocol.accept(Request(path, Headers(headers)))
    protocol.send_response(response)
    _flush(connection, protocol)
    if protocol.state is not State.OPEN:
        return  # the handshake was refused (no v4 offered): the 4xx answer is sent
    result = run(namespace, pod, command) if run is not None else _not_found(command)
    for channel, data in ((_STDOUT, result.stdout), (_STDERR, result.stderr)):
        if data:
            protocol.send_binary(bytes([channel]) + data)
    protocol.send_binary(bytes([_ERROR]) + _status(result.exit_code))
    protocol.send_close(1000)
    _flush(connection, protocol)
    connection.settimeout(10)
    try:
        while protocol.state is not State.CLOSED:
            data = connection.recv(65536)
            if not data:
                break
            protocol.receive_data(data)
            _flush(connection, protocol)
    except OSError:
        pass  # the client went away without its close frame: nothing left to answer
    connection.close()


def _not_found(command: Sequence[str]) -> ExecResult:
    name = command[0] if command else ""
    return ExecResult(stderr=f"exec: {name!r}: executable file not found\n".encode(), exit_code=126)


def _flush(connection: socket.socket, protocol: Any) -> None:
    for chunk in protocol.data_to_send():
        if chunk:
            connection.sendall(chunk)
