"""Two runs on one Ray cluster never share a Serve application."""

from __future__ import annotations

from rlx.config import build_config
from rlx.orchestration.controller import Controller


def controller(tmp_path, name: str, folder: str) -> Controller:
    return Controller(build_config({"logging": {"name": name, "run_dir": str(tmp_path / folder)}}))


def test_serve_applications_are_named_after_the_run(tmp_path):
    a, b, again = controller(tmp_path, "exp", "a"), controller(tmp_path, "exp", "b"), controller(tmp_path, "exp", "a")
    assert a.app_name("actor").startswith("rlx-exp-") and a.app_name("actor").endswith("-actor")
    assert a.app_name("actor") != b.app_name("actor")  # same name, other run directory
    assert a.app_name("actor") == again.app_name("actor")  # stable for a resumed run
    assert controller(tmp_path, "a b/../c", "c").app_name("rollout").startswith("rlx-a_b_.._c-")
