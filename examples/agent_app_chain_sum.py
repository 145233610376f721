"""An agent app for chain_sum, written against the plain `openai` client (rlx agent-app mode).

rlx calls `play` once per dataset row, in a process of its own, with the base URL of that row's
episode and a bearer token; whatever the app asks the model there is what rlx trains on. rlx
records the exact tokens server-side, so the app deals in text only. Its return value is the
episode's reward. Point a run at it with

    rollout:
      agent_app: examples.agent_app_chain_sum:play

The app asks the question; if the reply holds no number it asks once more, re-sending the whole
conversation as any chat program does. rlx sees that the second prompt extends the first prompt and
reply token for token and trains on both turns as one trajectory, with the nudge masked out.
"""

from __future__ import annotations

import re
from typing import Any

from openai import OpenAI

SYSTEM = "Add and subtract the numbers step by step, then give the final result as a number."
NUDGE = "Reply with just the final number."
NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> int | None:
    numbers = NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


def ask(client: OpenAI, messages: list[dict[str, str]]) -> str:
    # No temperature or max_tokens: the server samples at the run's rollout settings.
    reply = client.chat.completions.create(model="policy", messages=messages)
    return reply.choices[0].message.content or ""


def play(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key)
    question = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = ask(client, messages)
    answer = last_number(reply)
    if answer is None:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": NUDGE}]
        answer = last_number(ask(client, messages))
    return 1.0 if answer is not None and str(answer) == row["label"].strip() else 0.0
