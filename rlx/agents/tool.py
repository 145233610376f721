"""What a tool is: the interface a built-in or user tool implements (`rlx.agents.tools` runs them).

Apart from `rlx.agents.tools` so that the built-in tools (`calculator`, `sandbox`) import the
interface without importing the ToolBox that registers them.
"""

from __future__ import annotations

import abc


class ToolError(Exception):
    """A failure the tool explains itself: the model sees the message as is, the outcome is "error"."""


class ToolTimeout(ToolError):
    """The tool stopped its own work at its deadline: the outcome is "timeout"."""


class Tool(abc.ABC):
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    timeout_s: float = 10.0
    grace_s: float = 0.0  # extra wait past timeout_s for a tool that enforces timeout_s itself

    @abc.abstractmethod
    def run(self, arguments: dict) -> str:
        """The observation for valid `arguments`; may raise (the ToolBox turns that into an error)."""

    def spec(self) -> dict:
        """The OpenAI function-tool format, which chat templates with tool support render."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def close(self) -> None:
        """Release what the tool holds (connections, pools)."""
