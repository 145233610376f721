"""`rollout.engine` is validated without importing any engine, and the error modules import nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlx.config import ConfigError, RolloutConfig, build_config
from rlx.errors import ConfigError as ErrorsConfigError
from rlx.errors import DataError, UserError
from rlx.generation_engines import GENERATION_ENGINES

# a fresh interpreter: this test process has long imported the engines through other tests
NO_ENGINE_IMPORT = """
import sys
import rlx.config
config = rlx.config.build_config({"rollout": {"engine": "vllm"}})
assert config.rollout.engine == "vllm"
engines = sorted(m for m in sys.modules if m.startswith(("rlx.engines", "torch", "vllm", "sglang")))
assert not engines, engines
"""


def test_config_validates_engine_names_without_importing_engines():
    done = subprocess.run([sys.executable, "-c", NO_ENGINE_IMPORT], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_config_error_keeps_its_old_home():
    assert ConfigError is ErrorsConfigError
    assert issubclass(ConfigError, UserError) and issubclass(DataError, UserError)


def test_unknown_engine_names_the_choices():
    with pytest.raises(ConfigError) as info:
        build_config({"rollout": {"engine": "tgi"}})
    message = str(info.value)
    assert "rollout.engine = 'tgi'" in message
    assert "hf, sglang, vllm" in message


def test_the_genrm_judge_has_its_own_engine_settings():
    config = build_config({"rollout": {"engine": "sglang", "engine_options": {"url": "http://127.0.0.1:1"}},
                           "reward": {"name": "genrm"}})
    assert (config.reward.judge.engine, config.reward.judge.engine_options) == ("hf", {})  # not the policy's server
    with pytest.raises(ConfigError, match="reward.judge.engine = 'tgi'"):
        build_config({"reward": {"name": "genrm", "judge": {"engine": "tgi"}}})


def test_user_registered_engine_validates(monkeypatch):
    monkeypatch.setattr(GENERATION_ENGINES, "_entries", dict(GENERATION_ENGINES._entries))  # undone after
    with pytest.raises(ValueError, match="'echo'"):
        RolloutConfig(engine="echo")
    GENERATION_ENGINES.register("echo")(lambda spec: (None, None))
    assert RolloutConfig(engine="echo").engine == "echo"
    from rlx.engines.generation import GENERATION_ENGINES as reexported

    assert reexported is GENERATION_ENGINES and "echo" in reexported
