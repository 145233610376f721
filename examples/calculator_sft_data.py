"""Write warm-start conversations for examples/chain_sum_calculator_smollm2.yaml (`rlx sft` data).

Each conversation is what a multi-turn rollout of that config shows the model (its system prompt,
worked example and tools), followed by the ideal episode: a calculator call with the problem's
expression, the calculator's exact result, the final number. Prompts come from the run's own train
split, never from its held-out split.

    python examples/calculator_sft_data.py runs/calculator_sft.jsonl --count 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlx.agents.calculator import evaluate, format_number
from rlx.agents.tools import build_tool
from rlx.config import load_config
from rlx.data import load_splits

CONFIG = Path(__file__).with_name("chain_sum_calculator_smollm2.yaml")


def expression_of(question: str) -> str:
    """'State the final answer to the following arithmetic problem: 361 - 220 - 607 =' -> '361 - 220 - 607'."""
    return question.rsplit(":", 1)[1].strip().rstrip("=").strip()


def conversation(question: str, system_prompt: str, examples: list[dict], tools: list[dict]) -> dict:
    expression = expression_of(question)
    result = format_number(evaluate(expression))
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return {"messages": [{"role": "system", "content": system_prompt}, *examples,
                         {"role": "user", "content": question},
                         {"role": "assistant", "content": None, "tool_calls": [{"function": call}]},
                         {"role": "tool", "name": "calculator", "content": result},
                         {"role": "assistant", "content": result}],
            "tools": tools}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--config", type=Path, default=CONFIG)
    args = parser.parse_args()
    config = load_config(args.config)
    agent = config.rollout.agent
    train, _ = load_splits(config.data)
    tools = [build_tool(tool.name, tool.options).spec() for tool in agent.tools]
    rows = train[-args.count:]  # the end of the train split: the first RL steps start at its beginning
    lines = [json.dumps(conversation(row.question, agent.system_prompt, agent.examples, tools)) for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} conversations to {args.out}")


if __name__ == "__main__":
    main()
