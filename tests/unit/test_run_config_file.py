"""The run directory's config.yaml (L11): owner-only, without the secrets a config may hold inline
(alert URLs, an engine's api_key); Adam's betas range-checked; checkpoint folders that sort by step
past 999,999 steps."""

from __future__ import annotations

import stat

import pytest
import yaml

from rlx.checkpoints import newest_complete, write_marker
from rlx.config import ConfigError, build_config
from rlx.orchestration.run_dir import prepare_run_dir, step_name

SECRETS = {"logging": {"alerts": ["tgram://123456:SECRET-BOT-TOKEN/chat"]},
           "rollout": {"engine": "sglang", "engine_options": {"url": "http://127.0.0.1:30000",
                                                              "api_key": "SECRET-API-KEY"}}}


def test_config_yaml_is_the_owners_alone_and_holds_no_inline_secret(tmp_path):
    config = build_config({**SECRETS, "logging": {**SECRETS["logging"], "run_dir": str(tmp_path / "run")}})
    written = prepare_run_dir(config, resume=False, overwrite=False) / "config.yaml"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    text = written.read_text()
    assert "SECRET" not in text
    assert "# logging.alerts left out (a secret)" in text
    assert "# rollout.engine_options.api_key left out (a secret)" in text
    data = yaml.safe_load(text)
    assert data["rollout"]["engine_options"] == {"url": "http://127.0.0.1:30000"} and data["logging"]["alerts"] == []
    assert config.logging.alerts and "SECRET" in config.to_yaml()  # the run itself keeps them
    written.chmod(0o644)  # an older run's file
    (written.parent / "checkpoints" / "step_000001").mkdir(parents=True)
    write_marker(written.parent / "checkpoints" / "step_000001")
    prepare_run_dir(config, resume=True, overwrite=False)
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


@pytest.mark.parametrize("betas", [(1.0, 0.99), (0.9, -0.1), (0.9, 1.5)])
def test_adam_betas_outside_0_1_are_refused_naming_the_field(betas):
    with pytest.raises(ConfigError, match=r"train\.betas"):
        build_config({"train": {"betas": list(betas)}})


def test_checkpoint_folders_sort_by_step_past_999999(tmp_path):
    steps = [5, 999_999, 1_000_000, 10_000_000, 123_456_789]
    assert sorted(map(step_name, steps)) == [step_name(s) for s in steps]
    for step in (999_999, 1_000_000):
        (tmp_path / step_name(step)).mkdir()
        write_marker(tmp_path / step_name(step))
    assert newest_complete(tmp_path, tmp_path).name == "step_~1000000"
