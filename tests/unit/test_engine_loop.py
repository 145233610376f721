"""EngineLoop: requests submitted one at a time batch together, and every request ends (result or error)."""

from __future__ import annotations

import threading

import pytest

from rlx.engines.generation import EngineSpec, build_generation_engine
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.engine_loop import EngineLoop, EngineLoopStopped

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture()
def engine_and_prompts(tiny_path):
    engine, tokenizer = build_generation_engine("hf", EngineSpec(tiny_path, max_batch_size=8))
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("hello", "2+2?", "abc")]
    return engine, prompts


@pytest.fixture()
def loop(engine_and_prompts):
    loop = EngineLoop(engine_and_prompts[0])
    yield loop
    loop.stop()


def test_requests_submitted_apart_decode_together_and_match_a_batch(loop, engine_and_prompts):
    engine, prompts = engine_and_prompts
    loop.pause()  # hold decoding so the three single submissions meet in one batch
    futures = [loop.submit(ids, GREEDY) for ids in prompts]
    loop.resume()
    results = [future.result(timeout=30) for future in futures]
    assert loop.peak_batch == 3
    expected = engine.generate([GenerationRequest(i, ids) for i, ids in enumerate(prompts)], GREEDY)
    assert [r.prompt_ids for r in results] == prompts
    assert [r.response_ids for r in results] == [r.response_ids for r in expected]


def test_calls_run_on_the_engine_thread_even_while_paused(loop):
    loop.pause()
    assert loop.run_on_engine_thread(lambda: threading.current_thread().name) == "rlx-engine-loop"
    with pytest.raises(ZeroDivisionError):
        loop.run_on_engine_thread(lambda: 1 / 0)  # the caller gets the error; the loop lives on
    assert loop.run_on_engine_thread(lambda: 2) == 2


def test_a_cancelled_request_is_never_decoded(loop, engine_and_prompts):
    prompts = engine_and_prompts[1]
    loop.pause()
    dropped, kept = loop.submit(prompts[0], GREEDY), loop.submit(prompts[1], GREEDY)
    assert dropped.cancel()
    loop.resume()
    assert kept.result(timeout=30).prompt_ids == prompts[1]
    assert dropped.cancelled() and loop.peak_batch == 1


def test_an_engine_error_reaches_the_request_and_the_loop_goes_on(loop, engine_and_prompts):
    prompts = engine_and_prompts[1]
    bad = loop.submit([10**6], GREEDY)  # outside the vocabulary: the model's embedding raises
    with pytest.raises(IndexError):
        bad.result(timeout=30)
    assert loop.submit(prompts[0], GREEDY).result(timeout=30).prompt_ids == prompts[0]


def test_stop_fails_waiting_requests_and_refuses_new_ones(engine_and_prompts):
    engine, prompts = engine_and_prompts
    loop = EngineLoop(engine)
    loop.pause()
    waiting = loop.submit(prompts[0], GREEDY)
    loop.stop()
    with pytest.raises(EngineLoopStopped):
        waiting.result(timeout=5)
    with pytest.raises(EngineLoopStopped, match="has stopped"):
        loop.submit(prompts[0], GREEDY)
    with pytest.raises(EngineLoopStopped):
        loop.run_on_engine_thread(lambda: None)
