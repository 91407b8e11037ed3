"""CurveZMQ on internal TCP sockets: cluster members talk, strangers get nothing through,
and `memserve up --internal-transport tcp` serves with its workers on encrypted TCP."""

from __future__ import annotations

import json
import urllib.request

import zmq
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server
from memserve.ipc.curve import ENV_VAR, CurveKeys, release, secure_client, secure_server


def _server(ctx: zmq.Context, keys: CurveKeys) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, keys)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _client(ctx: zmq.Context, address: str, keys: CurveKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    sock.send(b"allocate 2900 blocks")
    return sock


def test_only_cluster_clients_get_through() -> None:
    keys = CurveKeys.generate()
    ctx = zmq.Context()
    server, address = _server(ctx, keys)
    plain = _client(ctx, address, None)
    other = CurveKeys.generate()  # right server key, a client key the cluster never made
    forged = _client(ctx, address, CurveKeys(keys.server_public, keys.server_secret,
                                             other.client_public, other.client_secret))
    member = _client(ctx, address, keys)
    try:
        assert server.poll(5000), "the cluster's own client was not heard"
        _identity, payload = server.recv_multipart()
        assert payload == b"allocate 2900 blocks"
        assert not server.poll(1000), "a client without the cluster's key got a message through"
    finally:
        for s in (plain, forged, member, server):
            s.close(0)
        release(ctx)
        ctx.term()


def test_keys_round_trip_through_the_environment() -> None:
    keys = CurveKeys.generate()
    assert CurveKeys.from_env(keys.to_env()) == keys


def test_serves_over_curve_tcp(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    server = start_server(["--internal-transport", "tcp", "--num-blocks", "128"], tmp_path / "memserve.log", cwd=REPO)
    try:
        request = urllib.request.Request(
            server.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": server.model, "prompt": "The capital of France is", "max_tokens": 4,
                             "temperature": 0, "ignore_eos": True}).encode())
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        pid = server.get_json("/health")["workers"][0]["pid"]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"curve" not in f.read().lower()  # keys travel in the environment only
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert f"{ENV_VAR}=".encode() in f.read()
    finally:
        stop_server(server)
