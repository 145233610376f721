"""The async driver as the management API drives it (`AsyncRun` is the API's RunControl), without
a cluster: what it refuses once the run is stopping."""

from __future__ import annotations

import requests

from rlx.config import RunConfig
from rlx.obs import Alerts
from rlx.orchestration.api import ApiServer
from rlx.orchestration.async_run import AsyncRun, RunInputs
from rlx.orchestration.faults import DriverFaults
from rlx.orchestration.plan import build_plan


def test_a_scale_request_after_stop_is_refused_with_409(tmp_path):
    """Security review M4: a scale arriving once a stop was requested must not redeploy roles that are
    shutting down. Nothing is scaled: the Controller has no cluster here, so a scale that went
    through would fail with a 500, not a 409."""
    config = RunConfig(train={"mode": "async"})
    run = AsyncRun(config, tmp_path, print, Alerts([], "test"), DriverFaults(config, build_plan(config)),
                   RunInputs([], [], None))
    server = ApiServer(run, tmp_path).start()
    try:
        auth = {"Authorization": f"Bearer {server.token}"}
        stopped = requests.post(server.url + "/v1/stop", headers=auth, timeout=10)
        assert stopped.status_code < 300, stopped.text
        refused = requests.post(server.url + "/v1/rollout/scale", json={"replicas": 2}, headers=auth, timeout=10)
        assert refused.status_code == 409, refused.text
        assert refused.json()["detail"] == "the run is stopping (a stop was requested or its last step is done): no scale now"
    finally:
        server.stop()
