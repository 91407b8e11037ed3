"""Session routing needs the session's name: the body's ``session_id`` field or, for
clients that cannot add body fields, the ``x-session-id`` header (the body wins)."""

from __future__ import annotations

from helpers.fake_engine import MODEL, FakeEngine, async_test, post, serve


@async_test
async def test_the_session_id_comes_from_the_body_or_the_x_session_id_header(tokenizer):
    engine = FakeEngine(tokenizer)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with serve(engine, tokenizer) as client:
        assert (await post(client, "/v1/chat/completions", body))[0] == 200
        async with client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"},
                               headers={"x-session-id": "from-header"}) as resp:
            assert resp.status == 200
        async with client.post("/v1/chat/completions", json=body | {"session_id": "from-body"},
                               headers={"x-session-id": "from-header"}) as resp:
            assert resp.status == 200
    assert [r["session_id"] for r in engine.requests] == [None, "from-header", "from-body"]
