"""What every config section shares: unknown keys are errors, and YAML reads numbers as YAML 1.2 does."""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-6` as a string; accept YAML 1.2 floats so free-form dicts get numbers too."""


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
