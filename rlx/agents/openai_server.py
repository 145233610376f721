"""An OpenAI-compatible endpoint on loopback for agent apps, recording every call server-side.

Each episode has its own base URL, `http://127.0.0.1:<port>/episodes/<episode_id>/v1`, so a call
is tied to its episode whichever process makes it. Routes under it:
- `POST /chat/completions`: the messages rendered with the tokenizer's chat template (`tools`
  passed to it, or described in the system prompt when the template has no tool support), as
  `rlx.agents.chat.ChatTokens` renders them for multi-turn rollouts;
- `POST /completions`: a text prompt (encoded without special tokens, as rlx encodes raw prompts)
  or a list of token ids;
- `GET /models`.
Non-streaming only, one choice per call (`n=1`). Sampling takes the request's `temperature`
(unless the server fixes one: the trainer scores tokens at the rollout's temperature), `top_p`,
`max_tokens` (capped at the server's per-call maximum, never refused for being over it), `stop`
(cut from the returned text as OpenAI does, kept in the recorded tokens) and `seed`. Fields that
would change the sampling distribution in ways the engine cannot (penalties, `logit_bias`,
`top_logprobs`, a `response_format` other than text) are refused with 400; other fields are
ignored. Any `model` name is accepted; responses name the server's.
With `tools`, a completion holding Hermes-style `<tool_call>{json}</tool_call>` blocks comes back
as `message.tool_calls` (the text before the first block is the content).

Each call is recorded in its episode before the reply is sent (`rlx.agents.episodes`): the prompt
ids as rendered, the completion ids and log-probs as generated, the weight versions. An unknown or
ended episode is 404; a call still generating when its episode ends is answered 404 and not kept.

`rlx.http_guard.Guard` fronts the app, as it fronts the management API: Host header, bearer token
and concurrency are checked before the body is read, and the body has a size limit.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rlx.agents.chat import ChatTokens
from rlx.agents.episodes import (
    CallRecord,
    EpisodeCalls,
    EpisodeClosed,
    EpisodeRecorder,
    Episodes,
    continued,
    merge_calls,
)
from rlx.agents.parsers import parse_hermes
from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.engine_loop import EngineLoop, EngineLoopStopped
from rlx.http_guard import LOOPBACK_NAMES, Guard, ServerThread

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlx.engines.generation.base import GenerationResult

TOOL_CALL_OPEN = "<tool_call>"  # where the content of a turn with Hermes tool calls ends


@dataclass(frozen=True)
class ServerLimits:
    """What one call may ask for, and how the server is hardened."""

    max_tokens: int = 256  # completion tokens per call (rollout.max_new_tokens: per turn)
    # an episode's limits (rollout.agent_app_max_*): a call past one is refused (400) and the episode
    # fails (`limit`); a call nearing max_trajectory_tokens gets only the new tokens left
    max_prompt_tokens: int | None = None  # a rendered prompt's tokens
    max_calls: int | None = None  # calls per episode
    max_trajectory_tokens: int | None = None  # response tokens of a merged trajectory (policy and in between)
    temperature: float | None = None  # sample every call at this temperature; None: the request's
    max_body_bytes: int = 8 * 1024 * 1024  # a whole conversation with tool outputs
    max_concurrent: int = 256  # requests in flight (each waits on its generation)


class ApiError(Exception):
    """Answered as OpenAI's error object, so the `openai` client raises its matching error class."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class SamplingRequest(BaseModel):
    """Fields chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str = ""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def refusal(self) -> tuple[str, str] | None:
        """(param, why) for a request this server cannot serve as asked."""
        if self.n != 1:
            return "n", f"n={self.n}: this server returns one choice per call; make n separate calls"
        if self.stream:
            return "stream", "streaming is not served; call with stream=false"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if isinstance(self.stop, list) and (len(self.stop) > 4 or not all(self.stop)):
            return "stop", "stop takes at most 4 non-empty strings"
        return None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) and self.stop else tuple(self.stop or ())


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def refusal(self) -> tuple[str, str] | None:
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not served; logprobs=true returns each token's log-prob"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().refusal()


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    def refusal(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "top log-probs are not served; logprobs=0 returns each token's log-prob"
        if self.echo:
            return "echo", "echo is not supported"
        return super().refusal()


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: text parts joined into one string, a missing
    content as "", tool-call arguments (a JSON string on the wire) as the object they encode."""
    shaped = []
    for index, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise ApiError(400, f"messages[{index}]: only text content parts are supported", "messages")
            message["content"] = "".join(str(part.get("text", "")) for part in content)
        elif content is None:
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [_decoded_arguments(call) for call in message["tool_calls"]]
        shaped.append(message)
    return shaped


def _decoded_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def assistant_message(text: str, finish_reason: str, tools_given: bool) -> tuple[dict[str, Any], str]:
    """The reply's message and finish reason; Hermes tool calls become `tool_calls` when tools were given."""
    calls = parse_hermes(text).calls if tools_given else []
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    content = text.split(TOOL_CALL_OPEN, 1)[0].strip()
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                   "function": {"name": call.name, "arguments": json.dumps(call.arguments)}} for call in calls]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"


class AgentServer:
    """The endpoint of one rollout engine. `open_episode` hands out a base URL's episode id,
    `close_episode` returns what it recorded; `start`/`stop` run it on a thread of its own.
    The EngineLoop is the caller's: the server submits to it and never stops it."""

    def __init__(self, loop: EngineLoop, tokenizer: PreTrainedTokenizerBase, limits: ServerLimits | None = None,
                 host: str = "127.0.0.1", port: int = 0, model_name: str = "rlx-policy") -> None:
        self.loop, self.tokenizer = loop, tokenizer
        self.limits = limits or ServerLimits()
        self.model_name = model_name
        self.token = secrets.token_urlsafe(32)
        self.episodes = Episodes()
        self.created = int(time.time())
        app = Guard(self._build_app(), self.token, LOOPBACK_NAMES | {host.lower()}, self.limits.max_body_bytes,
                    self.limits.max_concurrent, token_hint="the api_key rlx passes to the agent app")
        self._serving = ServerThread(app, host, port, "the agent-app endpoint", "rlx-agent-server")
        self.port, self.url = self._serving.port, self._serving.url

    def base_url(self, episode_id: str) -> str:
        return f"{self.url}/episodes/{episode_id}/v1"

    def open_episode(self) -> str:
        episode_id = uuid.uuid4().hex
        self.episodes.open(episode_id)
        return episode_id

    def close_episode(self, episode_id: str) -> EpisodeCalls:
        return self.episodes.close(episode_id)

    def start(self, timeout_s: float = 30.0) -> Self:
        """Returns once the server accepts connections."""
        self._serving.start(timeout_s)
        return self

    def stop(self) -> None:
        self._serving.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlx agent-app endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, _api_error)
        app.add_exception_handler(RequestValidationError, _invalid_request)

        @app.get("/episodes/{episode_id}/v1/models")
        def models(episode_id: str) -> dict[str, Any]:
            self._recorder(episode_id)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "rlx"}]}

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat(episode_id: str, request: ChatRequest) -> dict[str, Any]:
            recorder = self._recorder(episode_id)
            _check(request)
            prompt_ids = await asyncio.to_thread(self._render, request)
            limit = request.max_completion_tokens or request.max_tokens
            result, call = await self._generate(recorder, prompt_ids, request, limit)
            message, finish_reason = assistant_message(call.text, call.finish_reason, bool(request.tools))
            logprobs = {"content": list(self._token_logprobs(result))} if request.logprobs else None
            choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
            return self._reply("chatcmpl", "chat.completion", choice, result)

        @app.post("/episodes/{episode_id}/v1/completions")
        async def completions(episode_id: str, request: CompletionRequest) -> dict[str, Any]:
            recorder = self._recorder(episode_id)
            _check(request)
            prompt_ids = await asyncio.to_thread(self._encode, request.prompt)
            result, call = await self._generate(recorder, prompt_ids, request, request.max_tokens)
            logprobs = None
            if request.logprobs is not None:
                entries = list(self._token_logprobs(result))
                logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                            "top_logprobs": None, "text_offset": None}
            choice = {"index": 0, "text": call.text, "finish_reason": call.finish_reason, "logprobs": logprobs}
            return self._reply("cmpl", "text_completion", choice, result)

        return app

    def _recorder(self, episode_id: str) -> EpisodeRecorder:
        try:
            return self.episodes.get(episode_id)
        except EpisodeClosed:
            raise ApiError(404, f"episode {episode_id!r} is unknown or has ended", code="episode_not_found") from None

    def _render(self, request: ChatRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
        messages = template_messages(request.messages)
        try:
            return ChatTokens(self.tokenizer, request.tools).prompt_ids_as_text(messages)
        except Exception as error:  # noqa: BLE001 - the template rejected these messages (jinja raises anything)
            raise ApiError(400, f"the chat template cannot render these messages: {error}", "messages") from None

    def _encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        vocab = len(self.tokenizer)
        if not ids or not all(0 <= token < vocab for token in ids):
            raise ApiError(400, f"the prompt needs at least one token, each id in [0, {vocab})", "prompt")
        return ids

    def _params(self, request: SamplingRequest, max_tokens: int | None, budget: int) -> SamplingParams:
        limits = self.limits
        temperature = limits.temperature if limits.temperature is not None else request.temperature
        return SamplingParams(temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if request.top_p is None else request.top_p,
                              max_new_tokens=min(max_tokens or limits.max_tokens, limits.max_tokens, budget),
                              stop=request.stops(), seed=request.seed)

    def _budget(self, recorder: EpisodeRecorder, prompt_ids: list[int]) -> int:
        """New tokens this call may generate before the trajectory it continues (or starts) passes
        `max_trajectory_tokens`; the tokens between that trajectory's context and this prompt count."""
        cap = self.limits.max_trajectory_tokens
        if cap is None:
            return self.limits.max_tokens
        extended = continued(merge_calls(recorder.calls()), prompt_ids)
        used = 0 if extended is None else len(extended.response_ids) + len(prompt_ids) - len(extended.context_ids)
        return cap - used

    def _check_limits(self, recorder: EpisodeRecorder, prompt_ids: list[int]) -> int:
        """This call's new-token budget; a call past a limit is refused (400) and ends its episode."""
        limits = self.limits
        if recorder.refused is not None:
            raise ApiError(400, f"this episode has ended: {recorder.refused}", "messages", "episode_ended")
        budget = self._budget(recorder, prompt_ids)
        if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
            _refuse(recorder, "context_length_exceeded", f"the prompt has {len(prompt_ids)} tokens; this server "
                    f"takes at most {limits.max_prompt_tokens} (rollout.agent_app_max_prompt_tokens)")
        if budget < 1:
            _refuse(recorder, "trajectory_too_long", f"this conversation has {limits.max_trajectory_tokens - budget} "
                    "response tokens, the most one trajectory may have (rollout.agent_app_max_trajectory_tokens="
                    f"{limits.max_trajectory_tokens})")
        if not recorder.admit(limits.max_calls):
            _refuse(recorder, "too_many_calls", f"this episode made its {limits.max_calls} calls, the most one "
                    "may make (rollout.agent_app_max_calls)")
        return budget

    async def _generate(self, recorder: EpisodeRecorder, prompt_ids: list[int], request: SamplingRequest,
                        max_tokens: int | None) -> tuple[GenerationResult, CallRecord]:
        budget = await asyncio.to_thread(self._check_limits, recorder, prompt_ids)
        params = self._params(request, max_tokens, budget)
        try:
            result = await asyncio.wrap_future(self.loop.submit(prompt_ids, params))
        except EngineLoopStopped as stopped:
            raise ApiError(503, f"the engine has stopped: {stopped}") from None
        text = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
        if result.finish_reason == "stop":
            text = next((text[:-len(stop)] for stop in params.stop if text.endswith(stop)), text)
        call = CallRecord(prompt_ids=list(prompt_ids), completion_ids=list(result.response_ids),
                          logprobs=list(result.logprobs), weight_version=result.weight_version,
                          last_weight_version=result.extra.get("last_weight_version", result.weight_version),
                          finish_reason=result.finish_reason, text=text, temperature=params.temperature)
        try:
            recorder.record(call)
        except EpisodeClosed:
            raise ApiError(404, f"episode {recorder.episode_id!r} ended while this call ran; it was not recorded",
                           code="episode_not_found") from None
        return result, call

    def _token_logprobs(self, result: GenerationResult) -> Iterator[dict[str, Any]]:
        for token_id, logprob in zip(result.response_ids, result.logprobs):
            token = self.tokenizer.decode([token_id])
            yield {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}

    def _reply(self, prefix: str, kind: str, choice: dict[str, Any], result: GenerationResult) -> dict[str, Any]:
        prompt, completion = len(result.prompt_ids), len(result.response_ids)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}


def _refuse(recorder: EpisodeRecorder, code: str, message: str) -> None:
    """Refuse a call over an episode limit: the episode ends there and fails (`limit`)."""
    recorder.refuse(message)
    raise ApiError(400, f"{message}; the episode ends here and fails", "messages", code)


def _check(request: SamplingRequest) -> None:
    refused = request.refusal()
    if refused is not None:
        raise ApiError(400, refused[1], refused[0])


async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
    return error.response()


async def _invalid_request(_request: Request, error: RequestValidationError) -> JSONResponse:
    """Pydantic's 422 as OpenAI's 400, naming the first bad field."""
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ())[1:])
    return ApiError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where or None).response()
