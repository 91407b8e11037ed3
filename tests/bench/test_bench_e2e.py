"""End-to-end tests of ``memserve bench``.

- Against a closed port and a server that fails every request: a one-line error and a
  non-zero exit.
- Against a small OpenAI-compatible server written here, whose timeline is known (first
  token after 40 ms, then one token every 15 ms): the measured TTFT/TBT must match it, the
  sessions must be replayed causally, Ctrl-C must still write the results.
- Against a live ``memserve up`` (the ``memserve_server`` fixture of tests/conftest.py;
  skipped while that fixture does not exist).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from memserve.bench import cli

REPO = Path(__file__).resolve().parents[2]
FIRST_TOKEN_S = 0.040
TOKEN_GAP_S = 0.015
NATURAL_LEN = 4  # the fake model's "EOS" comes after this many tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeOpenAIServer:
    """Streams ``answer <session> <turn> tK`` tokens on a fixed timeline, reports usage
    with cached tokens = the previous prompt of the same session, and logs every body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.sent_answers: dict[tuple[str, int], str] = {}
        self._last_prompt: dict[str, int] = {}
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["model"] == "broken":
            return web.json_response({"error": {"message": "model exploded", "type": "server_error"}}, status=500)
        session = body.get("session_id", "?")
        chat = "messages" in body
        turn = sum(m["role"] == "user" for m in body["messages"]) if chat else body["prompt"].count("User: ")
        n = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], NATURAL_LEN)
        prompt_tokens = (sum(len(m["content"]) for m in body["messages"]) if chat else len(body["prompt"])) // 4
        cached = self._last_prompt.get(session, 0)
        self._last_prompt[session] = prompt_tokens
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(chunk: dict | str) -> None:
            data = chunk if isinstance(chunk, str) else json.dumps(chunk)
            await resp.write(f"data: {data}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        tokens = [f"answer {session} {turn} t{i}. " if i == 0 else f"t{i}. " for i in range(n)]
        await asyncio.sleep(FIRST_TOKEN_S)
        for i, tok in enumerate(tokens):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            choice = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
            await send({"choices": [choice]})
        self.sent_answers[(session, turn)] = "".join(tokens)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await send({"choices": [], "usage": usage})
        await send("[DONE]")
        return resp


@pytest.fixture(scope="module")
def fake_server():
    with FakeOpenAIServer() as server:
        yield server


def _run_cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "memserve.bench.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
    )


def test_closed_port_fails_fast_with_one_clear_line(tmp_path):
    started = time.monotonic()
    out = tmp_path / "r.json"
    proc = _run_cli(["--base-url", f"http://127.0.0.1:{_free_port()}", "--no-progress", "-o", str(out)])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach the server" in lines[0]
    assert not out.exists()
    assert time.monotonic() - started < 20


def test_server_failing_every_request_aborts_with_its_message(fake_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["--base-url", fake_server.base_url, "--model", "broken", "--num-sessions", "4",
                   "--max-turns", "2", "--no-progress", "-o", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "500" in err and "model exploded" in err and "Traceback" not in err
    result = json.loads(out.read_text())
    assert result["aborted"] and result["errors"]["by_status"].get("500", 0) >= 1
    assert result["num_requests"]["ok"] == 0


def test_sessions_replay_causally_and_timeline_is_measured(fake_server, tmp_path):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    fake_server.bodies.clear()
    rc = cli.main(["--base-url", fake_server.base_url + "/v1", "--workload", "sharegpt", "--num-sessions", "3",
                   "--max-turns", "2", "--max-tokens", "8", "--slo-ttft-ms", "5000", "--slo-tbt-ms", "1",
                   "--seed", "7", "--no-progress", "-o", str(out), "--plot", str(plots)])
    assert rc == 0
    result = json.loads(out.read_text())

    # causal replay: turn 2 carries exactly what the server streamed for turn 1
    turn2 = [b for b in fake_server.bodies if sum(m["role"] == "user" for m in b["messages"]) == 2]
    assert len(turn2) >= 1 and len(fake_server.bodies) == 3 + len(turn2)
    for body in turn2:
        assert body["messages"][-2]["role"] == "assistant"
        assert body["messages"][-2]["content"] == fake_server.sent_answers[(body["session_id"], 1)]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["slo_ttft_ms"] == 5000 and body["slo_tbt_ms"] == 1 and "ignore_eos" not in body

    # the fake server's timeline: TTFT >= 40 ms, gaps >= 15 ms, natural length 4 tokens
    n = len(fake_server.bodies)
    assert result["num_requests"] == {"finished": n, "ok": n, "failed": 0}
    assert FIRST_TOKEN_S * 1000 <= result["ttft_ms"]["p50"] < FIRST_TOKEN_S * 1000 + 150
    assert TOKEN_GAP_S * 1000 * 0.9 <= result["tbt_ms"]["p50"] < TOKEN_GAP_S * 1000 + 100
    assert result["tbt_ms"]["count"] == n * (NATURAL_LEN - 1)
    assert result["tokens"]["output"] == n * NATURAL_LEN
    assert result["slo_attainment"]["ttft"] == 1.0 and result["slo_attainment"]["tbt"] == 0.0
    assert [(t["turn"], t["requests"]) for t in result["by_turn"]] == [(1, 3), (2, len(turn2))]
    assert result["by_turn"][0]["cached_token_ratio"] == 0.0 and result["by_turn"][1]["cached_token_ratio"] > 0
    assert result["throughput"]["requests_per_s"] > 0 and result["config"]["model"] == "fake-model"
    assert {p.name for p in plots.iterdir()} == {"cdf_ttft.png", "cdf_tbt.png", "cdf_jct.png", "ttft_by_turn.png"}


def test_fixed_output_len_sends_recorded_length_and_replays_recorded_answers(fake_server, tmp_path):
    fake_server.bodies.clear()
    out = tmp_path / "r.json"
    rc = cli.main(["--base-url", fake_server.base_url, "--num-sessions", "2", "--max-turns", "2",
                   "--fixed-output-len", "--max-tokens", "6", "--no-progress", "-o", str(out)])
    assert rc == 0
    assert all(b["ignore_eos"] is True and 1 <= b["max_tokens"] <= 6 for b in fake_server.bodies)
    turn2 = [b for b in fake_server.bodies if len(b["messages"]) == 3]
    for body in turn2:
        assert body["messages"][1]["content"] != fake_server.sent_answers[(body["session_id"], 1)]
    result = json.loads(out.read_text())
    assert result["tokens"]["output"] == sum(b["max_tokens"] for b in fake_server.bodies)


def test_completions_endpoint_sends_a_transcript(fake_server, tmp_path):
    fake_server.bodies.clear()
    out = tmp_path / "r.json"
    rc = cli.main(["--base-url", fake_server.base_url, "--endpoint", "completions", "--num-sessions", "2",
                   "--max-turns", "2", "--no-progress", "-o", str(out)])
    assert rc == 0
    later = [b for b in fake_server.bodies if b["prompt"].count("User: ") == 2]
    assert later
    for body in later:
        answer = fake_server.sent_answers[(body["session_id"], 1)]
        assert f"Assistant: {answer}" in body["prompt"] and body["prompt"].endswith("Assistant:")
    result = json.loads(out.read_text())
    assert result["num_requests"]["ok"] == len(fake_server.bodies)
    assert result["tokens"]["output"] == NATURAL_LEN * len(fake_server.bodies)


def test_sweep_and_compare(fake_server, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--base-url", fake_server.base_url, "--workload", "random", "--num-requests", "4",
              "--input-len", "32", "--max-tokens", "3", "--sweep-rate", "20,40", "--no-progress"]
    assert cli.main([*common, "--label", "A", "-o", str(a)]) == 0
    assert cli.main([*common, "--label", "B", "--concurrency", "1", "-o", str(b)]) == 0
    sweep = json.loads(a.read_text())
    assert [p["rate"] for p in sweep["sweep"]] == [20.0, 40.0]
    capsys.readouterr()
    plots = tmp_path / "cmp"
    assert cli.main(["compare", str(a), str(b), "--plot", str(plots)]) == 0
    table = capsys.readouterr().out
    assert "A@20/s" in table and "B@40/s" in table and "x)" in table
    assert (plots / "latency_vs_rate.png").is_file() and (plots / "cdf_ttft.png").is_file()


def test_ctrl_c_stops_cleanly_and_writes_what_was_measured(fake_server, tmp_path):
    out = tmp_path / "r.json"
    fake_server.bodies.clear()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memserve.bench.cli", "--base-url", fake_server.base_url, "--workload", "random",
         "--num-requests", "400", "--request-rate", "20", "--max-tokens", "2", "--no-progress", "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    deadline = time.monotonic() + 30
    while len(fake_server.bodies) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    result = json.loads(out.read_text())
    assert result["interrupted"] is True
    assert 1 <= result["num_requests"]["ok"] < 400


def test_live_memserve_small_sharegpt_run(request, tmp_path):
    try:
        server = request.getfixturevalue("memserve_server")
    except pytest.FixtureLookupError:
        pytest.skip("no memserve_server fixture (tests/conftest.py) yet")
    out = tmp_path / "live.json"
    rc = cli.main(["--base-url", server.base_url, "--model", server.model, "--num-sessions", "3",
                   "--max-turns", "2", "--max-tokens", "8", "--max-session-tokens", "1500",
                   "--no-progress", "-o", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["num_requests"]["ok"] == 6 and result["errors"]["count"] == 0
    for key in ("ttft_ms", "tbt_ms", "tpot_ms", "jct_ms"):
        assert set(result[key]) >= {"mean", "p50", "p90", "p99"} and result[key]["p50"] > 0
    assert 0 < result["tokens"]["output"] <= 6 * 8
    assert result["throughput"]["output_tokens_per_s"] > 0
    assert [t["turn"] for t in result["by_turn"]] == [1, 2]
    assert result["cached_token_ratio"] is not None
