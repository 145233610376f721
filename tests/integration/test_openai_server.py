"""Agent-app mode end to end: agent apps written against the real `openai` client run in the
reward pool's processes, call the OpenAI-compatible endpoint over real HTTP on 127.0.0.1, and the
server records each call's exact tokens and log-probs from a real (tiny, random) model.

The tiny model's greedy replies to "hello" contain no special token, so re-sending the chat
history re-renders them as the same tokens and the calls merge; a reply holding a special token
(which the app never sees in the text) would not merge, which `merge_calls`' own tests cover."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai
import pytest
import torch

from rlx.agents.agent_app import AgentAppRunner, check_app
from rlx.agents.episodes import CallRecord, EpisodeClosed, merge_calls
from rlx.agents.openai_server import AgentServer, ServerLimits, assistant_message, template_messages
from rlx.engines.generation import EngineSpec, build_generation_engine
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.engine_loop import EngineLoop
from rlx.engines.training import collate, token_logprobs
from rlx.errors import ConfigError
from rlx.rewards import RewardPool
from rlx.rewards.safe import MAX_ERROR_CHARS

APPS = "tests.integration.agent_apps"
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_path):
    return build_generation_engine("hf", EngineSpec(tiny_path, max_batch_size=8))


@pytest.fixture(scope="module")
def loop(engine_and_tokenizer):
    loop = EngineLoop(engine_and_tokenizer[0])
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def server(loop, engine_and_tokenizer):
    with AgentServer(loop, engine_and_tokenizer[1], ServerLimits(max_tokens=MAX_TOKENS)) as started:
        yield started


@pytest.fixture(scope="module")
def pool():
    with RewardPool(max_workers=2, confined=False) as shared:  # an agent app reaches the server
        yield shared


@pytest.fixture()
def episode(server):
    episode_id = server.open_episode()
    yield episode_id
    with contextlib.suppress(EpisodeClosed):  # most tests close it themselves
        server.close_episode(episode_id)


def _client(server, episode_id, api_key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url(episode_id), api_key=api_key or server.token, max_retries=0)


def _runner(server, pool, app, timeout_s=30.0) -> AgentAppRunner:
    return AgentAppRunner(server, f"{APPS}:{app}", timeout_s, pool=pool)


def _call(prompt, completion, logprobs=None, text="") -> CallRecord:
    return CallRecord(prompt, completion, logprobs or [-0.5] * len(completion), 3, 4, "length", text, 1.0)


def test_merge_rule_extends_the_longest_matching_trajectory_and_masks_what_is_between():
    calls = [_call([1, 2], [3, 4]), _call([9], [8]), _call([1, 2, 3, 4, 5, 6], [7]),
             _call([1, 2, 3], [0]),  # a retry of an earlier turn: its own sample
             _call([9, 8, 5], [6], text="last")]
    first, second, retry = merge_calls(calls)
    assert (first.prompt_ids, first.response_ids) == ([1, 2], [3, 4, 5, 6, 7])
    assert first.loss_mask == [1, 1, 0, 0, 1] and first.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert first.turns == 2 and first.masked_tokens == 2
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == ([9], [8, 5, 6], [1, 0, 1])
    assert second.final_text == "last" and second.finish_reason == "length"
    assert (second.behavior_version, second.last_behavior_version) == (3, 4)
    assert (retry.prompt_ids, retry.response_ids, retry.turns) == ([1, 2, 3], [0], 1)


def test_an_app_conversation_is_recorded_exactly_and_merged_where_the_prompt_extends(server, pool,
                                                                                    engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    row = {"prompt": "hello", "label": "5",
           "metadata": {"follow_ups": ["more", "again"], "sampling": GREEDY, "reward": 0.75}}
    with _runner(server, pool, "conversation") as runner:
        (result,) = runner.run_episodes([row])
    assert result.ok, result.error
    assert result.reward == 0.75 and result.calls == 4
    chat, unrelated = result.trajectories
    assert (chat.turns, unrelated.turns) == (3, 1), "the three chat calls merge; the unrelated call stands alone"
    assert chat.env_reward == unrelated.env_reward == 0.75, "every trajectory of the episode shares its reward"
    assert chat.prompt_ids == tokenizer("<u>hello\n<a>", add_special_tokens=False)["input_ids"]
    assert unrelated.prompt_ids == tokenizer("<u>unrelated\n<a>", add_special_tokens=False)["input_ids"]
    mask = chat.loss_mask
    observations = [i for i, m in enumerate(mask) if m == 0.0]
    observed = tokenizer.decode([chat.response_ids[i] for i in observations])
    assert observed == "\n<u>more\n<a>" + "\n<u>again\n<a>", "exactly the template's text between the turns is masked"
    # every policy turn is what the engine generates greedily from the context before it
    starts = [i for i, m in enumerate(mask) if m == 1.0 and (i == 0 or mask[i - 1] == 0.0)]
    for start, end in zip(starts, starts[1:] + [len(mask)]):
        turn_end = start + mask[start:end].count(1.0)
        context = chat.prompt_ids + chat.response_ids[:start]
        (again,) = engine.generate([GenerationRequest(0, context)], SamplingParams(temperature=0.0, max_new_tokens=6))
        assert chat.response_ids[start:turn_end] == again.response_ids
    # the recorded log-probs are the trainer's on every policy token
    batch = collate([chat.prompt_ids], [chat.response_ids], tokenizer.pad_token_id, [mask])
    with torch.no_grad():
        trained, _ = token_logprobs(engine.model, batch, 1.0)
    policy = torch.tensor(mask) == 1.0
    gap = (trained[0, :len(mask)][policy] - torch.tensor(chat.logprobs)[policy]).abs().max().item()
    assert gap < 1e-4
    assert all(lp == 0.0 for lp, m in zip(chat.logprobs, mask) if m == 0.0)
    assert chat.behavior_version == engine.weight_version


def test_an_async_app_with_concurrent_calls_gets_one_trajectory_per_call(server, pool):
    row = {"prompt": "2+2", "label": "4", "metadata": {"reward": -1.5}}
    with _runner(server, pool, "async_two_calls") as runner:
        (result,) = runner.run_episodes([row])
    assert result.ok, result.error
    assert result.reward == -1.5 and result.calls == 2
    assert sorted(len(t.prompt_ids) for t in result.trajectories) == [len("<u>2+2\n<a>"), len("<u>2+2?\n<a>")]
    assert all(t.turns == 1 and len(t.response_ids) <= 4 and t.masked_tokens == 0 for t in result.trajectories)


def test_a_misbehaving_app_fails_only_its_own_episode(server, pool):
    faults = ["raises", "hangs", "returns_text", "exits", "never_calls"]
    rows = [{"prompt": "p", "label": "", "metadata": {"fault": fault, "reward": 0.0}} for fault in faults]
    rows.insert(2, {"prompt": "p", "label": "", "metadata": {"reward": 2.0}})
    with _runner(server, pool, "by_row", timeout_s=4.0) as runner:
        start = time.monotonic()
        results = runner.run_episodes(rows)
        elapsed = time.monotonic() - start
    good = results.pop(2)
    assert good.ok and good.reward == 2.0 and len(good.trajectories) == 1
    assert [r.failure for r in results] == ["error", "timeout", "bad_value", "crash", "no_calls"]
    assert all(r.reward is None and all(t.env_reward is None for t in r.trajectories) for r in results)
    assert "the agent app is broken" in results[0].error and "rollout.agent_app_timeout_s=4.0s" in results[1].error
    assert "'great'" in results[2].error
    assert [r.calls for r in results] == [1, 1, 1, 1, 0], "calls made before the failure are still recorded"
    assert runner.failures == {"error": 1, "timeout": 1, "bad_value": 1, "crash": 1, "no_calls": 1}
    assert elapsed < 50, "the hung app was killed at its deadline"
    assert len(server.episodes) == 0, "every episode was closed"


def test_calls_past_an_episodes_limits_are_refused_and_fail_the_episode(loop, engine_and_tokenizer):
    """Review security-2026-12-05 N7: prompt tokens per call, calls per episode and a merged
    trajectory's response tokens are each capped: 400 to the client, and the episode fails (limit)."""
    limits = ServerLimits(max_tokens=4, max_prompt_tokens=20, max_calls=3, max_trajectory_tokens=12)
    with AgentServer(loop, engine_and_tokenizer[1], limits) as capped:
        episode = capped.open_episode()
        with pytest.raises(openai.BadRequestError, match="rollout.agent_app_max_prompt_tokens") as too_long:
            _client(capped, episode).completions.create(model="m", prompt=[40] * 21, max_tokens=2)
        assert too_long.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="this episode has ended"):
            _client(capped, episode).completions.create(model="m", prompt=[40], max_tokens=2)
        ended = capped.close_episode(episode)
        assert ended.calls == [] and "agent_app_max_prompt_tokens" in ended.refused

        episode = capped.open_episode()
        client = _client(capped, episode)
        for _ in range(3):
            client.completions.create(model="m", prompt=[40, 41], max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="rollout.agent_app_max_calls") as too_many:
            client.completions.create(model="m", prompt=[40, 41], max_tokens=1)
        assert too_many.value.code == "too_many_calls"
        ended = capped.close_episode(episode)
        assert len(ended.calls) == 3 and "made its 3 calls" in ended.refused

        episode = capped.open_episode()
        client = _client(capped, episode)
        first = client.completions.create(model="m", prompt=[40, 41], max_tokens=4, temperature=0)
        (call,) = capped.episodes.get(episode).calls()
        context = [40, 41, *call.completion_ids, *[42] * 6]  # continues it: 6 tokens in between
        second = client.completions.create(model="m", prompt=context, max_tokens=4, temperature=0)
        used = first.usage.completion_tokens + 6
        assert second.usage.completion_tokens <= 12 - used, "a call near the cap gets only the tokens left"
        grown = context + capped.episodes.get(episode).calls()[1].completion_ids + [42] * (12 - used)
        with pytest.raises(openai.BadRequestError, match="rollout.agent_app_max_trajectory_tokens=12"):
            client.completions.create(model="m", prompt=grown, max_tokens=4)
        ended = capped.close_episode(episode)
        assert len(ended.calls) == 2 and "trajectory" in ended.refused
        assert all(len(t.response_ids) <= 12 for t in merge_calls(ended.calls))


def test_an_app_that_calls_past_the_limit_fails_its_episode(loop, engine_and_tokenizer, pool):
    with AgentServer(loop, engine_and_tokenizer[1], ServerLimits(max_tokens=2, max_calls=4)) as capped, \
            _runner(capped, pool, "calls_until_refused") as runner:
        (result,) = runner.run_episodes([{"prompt": "p", "label": "", "metadata": {}}])
    assert result.failure == "limit" and result.reward is None and result.calls == 4
    assert "rollout.agent_app_max_calls" in result.error and runner.failures == {"limit": 1}


def test_an_apps_huge_error_message_is_cut(server, pool):
    with _runner(server, pool, "by_row") as runner:
        (result,) = runner.run_episodes([{"prompt": "p", "label": "", "metadata": {"fault": "raises_huge"}}])
    assert result.failure == "error" and "RuntimeError: xxx" in result.error
    assert len(result.error) < MAX_ERROR_CHARS + 100


def test_an_app_that_cannot_be_loaded_is_a_config_error(server, pool):
    with pytest.raises(ConfigError, match="rollout.agent_app"):
        check_app(f"{APPS}:missing")
    with pytest.raises(ConfigError, match="must take"):
        check_app("tests.integration.agent_apps:_one_call")
    with pytest.raises(ConfigError, match="package.module:function"):
        check_app("no_colon")


def test_chat_reply_is_openai_shaped_with_log_probs_as_recorded(server, episode):
    reply = _client(server, episode).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=10_000, logprobs=True, temperature=0.8, seed=5)
    (call,) = server.close_episode(episode).calls
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "rlx-policy"
    assert reply.usage.completion_tokens == len(call.completion_ids) <= MAX_TOKENS, "max_tokens is capped"
    assert reply.usage.prompt_tokens == len(call.prompt_ids) == len("<u>hi\n<a>")
    assert choice.message.content == call.text and choice.finish_reason == call.finish_reason
    assert [entry.logprob for entry in choice.logprobs.content] == call.logprobs
    assert call.temperature == 0.8


def test_each_call_records_the_weight_version_it_was_generated_with(server, loop, episode, engine_and_tokenizer):
    engine = engine_and_tokenizer[0]
    client, hi = _client(server, episode), [{"role": "user", "content": "hi"}]
    before = engine.weight_version
    client.chat.completions.create(model="m", messages=hi, max_tokens=2)
    loop.run_on_engine_thread(lambda: engine.load_weights(engine.model.state_dict(), before + 7))
    try:
        client.chat.completions.create(model="m", messages=hi, max_tokens=2)
    finally:
        loop.run_on_engine_thread(lambda: engine.load_weights(engine.model.state_dict(), before))
    first, second = server.close_episode(episode).calls
    assert (first.weight_version, first.last_weight_version) == (before, before)
    assert (second.weight_version, second.last_weight_version) == (before + 7, before + 7)


def test_text_completions_and_models(server, episode):
    client = _client(server, episode)
    assert [model.id for model in client.models.list()] == ["rlx-policy"]
    reply = client.completions.create(model="x", prompt="abc", max_tokens=3, logprobs=0, temperature=0)
    by_ids = client.completions.create(model="x", prompt=[40, 41], max_tokens=3)
    for empty in ("", [], [10**9]):
        with pytest.raises(openai.BadRequestError, match="at least one token"):
            client.completions.create(model="x", prompt=empty)
    text_call, ids_call = server.close_episode(episode).calls
    assert text_call.prompt_ids == server.tokenizer("abc", add_special_tokens=False)["input_ids"]
    assert ids_call.prompt_ids == [40, 41]
    assert reply.choices[0].logprobs.token_logprobs == text_call.logprobs and reply.choices[0].text == text_call.text
    assert by_ids.usage.completion_tokens == len(ids_call.completion_ids) <= 3


def test_the_guard_and_refusals(server, loop, episode):
    with pytest.raises(openai.AuthenticationError):
        _client(server, episode, api_key="wrong").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    rebinding = httpx.post(f"{server.base_url(episode)}/chat/completions", json={"messages": []},
                           headers={"Host": "evil.example", "Authorization": f"Bearer {server.token}"})
    assert rebinding.status_code == 421
    with pytest.raises(openai.NotFoundError, match="unknown or has ended"):
        _client(server, "no-such-episode").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    client = _client(server, episode)
    hi = [{"role": "user", "content": "hi"}]
    for refused, name in [({"n": 2}, "n=2"), ({"stream": True}, "stream"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
                          ({"presence_penalty": 0.5}, "penalties"), ({"temperature": 3.0}, "temperature")]:
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(model="m", messages=hi, **refused)
    with pytest.raises(openai.BadRequestError, match="text content"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert server.close_episode(episode).calls == [], "refused calls are not recorded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="m", messages=hi)  # the episode has ended
    with AgentServer(loop, server.tokenizer, ServerLimits(max_body_bytes=2048, max_prompt_tokens=8)) as small:
        small_episode = small.open_episode()
        with pytest.raises(openai.APIStatusError) as too_big:
            _client(small, small_episode).chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 4096}])
        assert too_big.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="at most 8"):
            _client(small, small_episode).chat.completions.create(model="m", messages=[{"role": "user", "content": "a longer prompt"}])


def test_a_call_still_generating_when_its_episode_ends_is_answered_404_and_not_kept(server, loop, episode):
    loop.pause()  # the call waits in the loop's queue while the episode ends
    outcome = {}

    def call() -> None:
        try:
            _client(server, episode).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as error:
            outcome["status"] = error.status_code

    caller = threading.Thread(target=call)
    try:
        caller.start()
        deadline = time.monotonic() + 20
        while not loop._jobs and time.monotonic() < deadline:  # the loop exposes no queue length: read it
            time.sleep(0.01)
        assert loop._jobs, "the call reached the engine loop"
        assert server.close_episode(episode).calls == []
    finally:
        loop.resume()
        caller.join(timeout=30)
    assert outcome == {"status": 404}


def test_tool_calls_in_the_reply_and_in_the_history():
    text = 'Let me add.<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    message, finish = assistant_message(text, "stop", tools_given=True)
    assert finish == "tool_calls" and message["content"] == "Let me add."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "1+2"}'}
    assert assistant_message(text, "stop", tools_given=False) == ({"role": "assistant", "content": text}, "stop")
    history = template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert history[0]["content"] == "" and history[0]["tool_calls"][0]["function"]["arguments"] == {"expression": "1+2"}


def test_the_chain_sum_example_app_runs_end_to_end(server, pool):
    row = {"prompt": "What is 12 + 30?", "label": "42", "metadata": {}}
    with AgentAppRunner(server, "examples.agent_app_chain_sum:play", 30.0, pool=pool) as runner:
        (result,) = runner.run_episodes([row])
    assert result.ok, result.error
    assert result.reward in (0.0, 1.0) and result.calls in (1, 2), "a nudge only when the reply has no number"
    assert sum(t.turns for t in result.trajectories) == result.calls
    assert all(t.prompt_ids[:3] == server.tokenizer("<s>", add_special_tokens=False)["input_ids"]
               for t in result.trajectories), "each call starts from the system prompt"


@pytest.mark.slow
def test_smollm2_chat_turns_merge_and_match_the_templates_render():
    """A real chat template (SmolLM2's): the reply ends with <|im_end|>, which the template writes
    back, so a re-sent history extends the last call's prompt and reply token for token."""
    from rlx.models import resolve_model_path
    from tests.integration.agent_apps import conversation

    engine, tokenizer = build_generation_engine("hf", EngineSpec(resolve_model_path("smollm2-135m-instruct")))
    loop = EngineLoop(engine)
    row = {"prompt": "Say hello.", "label": "",
           "metadata": {"follow_ups": ["Are you sure?"], "sampling": {"temperature": 0, "max_tokens": 24}, "reward": 1.0}}
    try:
        with AgentServer(loop, tokenizer, ServerLimits(max_tokens=24)) as smol:
            episode_id = smol.open_episode()
            conversation(smol.base_url(episode_id), smol.token, row)  # the real openai client, in this process
            calls = smol.close_episode(episode_id).calls
    finally:
        loop.stop()
    chat, unrelated = merge_calls(calls)
    assert (chat.turns, unrelated.turns) == (2, 1)
    first, second = calls[0], calls[1]
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "Are you sure?"}, {"role": "assistant", "content": second.text}]
    rendered = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert rendered[:len(chat.context_ids)] == chat.context_ids


def test_a_runs_agent_app_rollout_takes_its_episode_limits_from_the_config(tiny_path, tmp_path):
    from rlx.orchestration.builder import build_rollout
    from tests.integration.test_colocate_loop import toy_config

    config = toy_config(tiny_path, tmp_path, rollout__agent_app=f"{APPS}:conversation", reward__name="environment",
                        rollout__agent_app_max_calls=5, rollout__agent_app_max_trajectory_tokens=300)
    limits = build_rollout(config, tiny_path).limits
    assert (limits.max_calls, limits.max_trajectory_tokens, limits.max_prompt_tokens) == (5, 300, 4096)
