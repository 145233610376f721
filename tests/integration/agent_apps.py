"""Agent apps for the agent-app tests (`tests.integration.agent_apps:<name>`), written against the
real `openai` client as a user would. Each returns the reward the row's metadata names, so a test
can check that the reward reaches the episode; the misbehaving ones fail in one way each."""

from __future__ import annotations

import asyncio
import os
import time
import zlib
from typing import Any

from openai import AsyncOpenAI, OpenAI

MODEL = "any-name"  # the server accepts any model name


def chat_turns(client: OpenAI, row: dict[str, Any]) -> None:
    """A conversation that grows: after the first call, each call re-sends the history with the
    model's last reply and the next user message from the row, as a chat program does."""
    sampling = row["metadata"]["sampling"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, **sampling)
    for follow_up in row["metadata"]["follow_ups"]:
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": follow_up}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, **sampling)


def conversation(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """One conversation of 1 + len(follow_ups) calls, then one unrelated call (a fresh conversation)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    chat_turns(client, row)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "unrelated"}],
                                   **row["metadata"]["sampling"])
    return row["metadata"]["reward"]


async def async_two_calls(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """`async def` with the async client: two calls at once, neither extends the other."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    questions = [row["prompt"], row["prompt"] + "?"]
    await asyncio.gather(*(client.chat.completions.create(model=MODEL, max_tokens=4,
                                                          messages=[{"role": "user", "content": q}])
                           for q in questions))
    await client.close()
    return row["metadata"]["reward"]


def _one_call(base_url: str, api_key: str) -> None:
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def raises(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    _one_call(base_url, api_key)
    raise RuntimeError("the agent app is broken")


def raises_huge(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    _one_call(base_url, api_key)
    raise RuntimeError("x" * 10_000_000)  # a 10 MB message


def hangs(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    _one_call(base_url, api_key)
    time.sleep(600)
    return 1.0


def returns_text(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    _one_call(base_url, api_key)
    return "great"  # type: ignore[return-value] - the fault under test


def exits(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    _one_call(base_url, api_key)
    os._exit(3)


def never_calls(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    return 1.0


def by_row(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Acts out the fault the row's metadata names (none: behaves), so one batch mixes good and bad."""
    fault = row["metadata"].get("fault")
    if fault is None:
        _one_call(base_url, api_key)
        return row["metadata"]["reward"]
    return {"raises": raises, "raises_huge": raises_huge, "hangs": hangs, "returns_text": returns_text, "exits": exits,
            "never_calls": never_calls}[fault](base_url, api_key, row)


def toy_chat(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Two chat turns in one conversation, then a side call in a fresh one (it continues nothing:
    a sample of its own); the reward varies with the final reply. On odd-numbered rows the app
    fails after its calls (fault injection: its episode must fail alone)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content or ""
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    final = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content or ""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"check: {final}"}])
    if row["metadata"]["index"] % 2:
        raise RuntimeError("this episode's app fails")
    return (zlib.crc32(final.encode()) % 1000) / 1000


def calls_until_refused(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Calls the model until the server refuses a call (a limit), then claims full marks."""
    import openai

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for _ in range(1000):
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row["prompt"]}],
                                           max_tokens=2)
        except openai.BadRequestError:
            break
    return 1.0
