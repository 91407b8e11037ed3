"""CurveZMQ on the internal sockets that listen on TCP.

On one machine every internal socket is an ``ipc://`` file in the gateway's private
(0700) runtime directory, so nothing but the HTTP port can be reached. With
``--internal-transport tcp`` (workers or peers reachable across hosts) anyone who reaches
a port could otherwise drive a worker: allocate its KV blocks, inject KV, fake its
outputs. So every TCP socket then speaks CurveZMQ: traffic is encrypted, and each server
socket accepts only clients that hold the cluster's client key (checked by a ZAP handler
in the socket's context). The gateway generates the keys at start and hands them to its
workers through their environment (``MEMSERVE_CURVE_KEYS``), never on the command line,
which any local user can read with ``ps``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

ENV_VAR = "MEMSERVE_CURVE_KEYS"
ZAP_DOMAIN = "memserve"


@dataclass(frozen=True)
class CurveKeys:
    """One key pair for every server socket and one for every client socket of the
    cluster; all are Z85 text, 40 characters each."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def to_env(self) -> str:
        # Z85 uses every printable separator, so the keys are simply concatenated.
        return b"".join((self.server_public, self.server_secret, self.client_public, self.client_secret)).decode()

    @classmethod
    def from_env(cls, value: str) -> CurveKeys:
        if len(value) != 160:
            raise ValueError(f"{ENV_VAR} must hold four Z85 keys of 40 characters")
        raw = value.encode()
        return cls(*(raw[i:i + 40] for i in range(0, 160, 40)))


def keys_from_environ() -> CurveKeys | None:
    """The cluster's keys when the gateway gave this process some, else None."""
    value = os.environ.get(ENV_VAR)
    return CurveKeys.from_env(value) if value else None


def needs_curve(address: str) -> bool:
    return address.startswith("tcp://")


class _ClusterClients:
    """ZAP credentials check: the one client key the cluster shares, nothing else."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public  # Z85, as the authenticator passes it

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key == self._key


_authenticators: dict[int, ThreadAuthenticator] = {}


def _authenticate(ctx: zmq.Context, keys: CurveKeys) -> None:
    """One ZAP handler per context (ZeroMQ asks the handler of the server socket's
    context); it holds a socket there, so ``release`` it before terminating the context."""
    if id(ctx) in _authenticators:
        return
    # The handler thread needs a plain context sharing the same underlying one.
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _ClusterClients(keys.client_public))
    _authenticators[id(ctx)] = auth


def release(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP handler, if it has one."""
    auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before ``bind``) a CurveZMQ server that admits only cluster clients."""
    _authenticate(sock.context, keys)
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before ``connect``) a CurveZMQ client of the cluster's servers."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def protect(sock: zmq.Socket, address: str, server: bool) -> None:
    """Secure ``sock`` before it binds (``server``) or connects to ``address``, when the
    address is TCP and the gateway gave this process the cluster's keys."""
    keys = keys_from_environ()
    if keys is None or not needs_curve(address):
        return
    (secure_server if server else secure_client)(sock, keys)
