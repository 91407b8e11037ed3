"""The disaggregated request's states (``gateway/routing/pd_handoff.py``), as the gateway
and the simulator both drive them: P's first token starts the handoff, a resume carries
every token sent so far and the prompt's cached count, and resumes are bounded."""

from __future__ import annotations

import pytest

from memserve.gateway.routing.pd_handoff import MAX_RESUMES, Handoff, Phase
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams


def handoff() -> Handoff:
    return Handoff(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=8)), prefill=0)


def out(tokens: list[int], cached: int = 0, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", tokens, finished, "length" if finished else None, num_cached_tokens=cached)


def test_the_first_token_of_a_request_that_goes_on_starts_the_handoff():
    h = handoff()
    assert not h.output(out([], cached=16))  # a prefill chunk: no token yet
    assert h.phase is Phase.PREFILL
    assert h.output(out([7], cached=16))
    assert h.phase is Phase.HANDOFF and h.tokens == [7] and h.cached == 16


def test_a_request_that_ends_with_its_first_token_stays_on_its_prefill_instance():
    h = handoff()
    assert not h.output(out([7], cached=16, finished=True))
    assert h.phase is Phase.PREFILL


def test_outputs_after_a_resume_report_the_prompts_cached_tokens_and_keep_every_token():
    h = handoff()
    h.output(out([7], cached=16))
    assert h.resume() and h.phase is Phase.DECODE
    later = out([8, 9], cached=0)  # the decode instance recomputed: it found nothing cached
    h.output(later)
    assert later.num_cached_tokens == 16 and h.tokens == [7, 8, 9]


def test_a_request_run_wholly_on_a_decode_instance_reports_what_it_found_there():
    h = handoff()
    h.run_on_decode()
    first = out([7], cached=5)
    h.output(first)
    assert h.cached == 5 and first.num_cached_tokens == 5 and h.resumes == 0


def test_a_retried_prefill_moves_to_the_new_instance_and_resumes_are_bounded():
    h = handoff()
    h.retried(2)
    assert h.prefill == 2 and h.phase is Phase.PREFILL
    h.output(out([7]))
    assert all(h.resume() for _ in range(MAX_RESUMES))
    assert not h.resume()


def test_a_retry_after_the_first_token_is_a_state_error():
    h = handoff()
    h.output(out([7]))
    with pytest.raises(AssertionError):
        h.retried(1)
