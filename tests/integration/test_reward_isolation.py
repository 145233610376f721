"""User reward code runs in a killable process pool: a reward that holds the GIL, exits, returns
garbage, blocks its event loop or raises fails only its own samples, within reward.timeout_s,
and leaves no thread or process behind. One warm pool serves the module (starting is the cost)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from rlx.data.sample import Sample
from rlx.errors import ConfigError
from rlx.rewards import RewardPool, RewardSpec, build_reward
from rlx.rewards.pool import RewardFailure, _Worker
from rlx.roles import Reward

BAD = "tests.integration.bad_rewards"
ESCAPING = "tests.integration.escaping_rewards"
TIMEOUT_S = 1.0
SLACK_S = 2.0  # a killed worker's replacement boots within the measured call


@pytest.fixture(scope="module")
def pool():
    with RewardPool(max_workers=2) as shared:
        yield shared


def _batch(fault: str | None, groups: int = 3) -> list[Sample]:
    """One sample per group; the middle one acts out `fault`, the others contain their label."""
    return [Sample(uid=i, group_id=i, response_text="the answer is 42", label="42",
                   metadata={"fault": fault} if fault and i == groups // 2 else {}) for i in range(groups)]


def _reward(fn: str, pool: RewardPool, scope: str = "sample") -> Reward:
    reward = Reward(build_reward(f"{BAD}:{fn}", "none"), timeout_s=TIMEOUT_S, pool=pool, scope=scope)
    reward.score(_batch(None))  # warm: a worker has started and loaded this reward
    return reward


@pytest.fixture
def others(pool) -> set[int]:
    """This process's children that are not this pool's workers when the test starts: a Ray cluster
    an earlier test stopped may still be exiting, or an earlier test's pool may not be closed yet.
    What each test here asserts is that it leaves nothing of its own behind."""
    return {child.pid for child in psutil.Process().children()} - set(pool.pids())


def _assert_only_pool_children(pool: RewardPool, others: set[int]) -> None:
    """Every reward process is a live pool worker: none leaked, none left a zombie."""
    children = [c for c in psutil.Process().children() if c.pid not in others]
    assert {c.pid for c in children} <= set(pool.pids())
    assert all(c.status() != psutil.STATUS_ZOMBIE for c in children)


@pytest.mark.parametrize("fn,fault,kind,error", [
    ("misbehaves", "gil_regex", "timeout", f"no result within reward.timeout_s={TIMEOUT_S}s"),
    ("misbehaves", "sys_exit", "error", "SystemExit: 3"),
    ("misbehaves", "os_exit", "crash", "exited with code 7"),
    ("misbehaves", "huge_int", "bad_value", "bad reward value 1000"),
    ("misbehaves", "raises", "error", "RuntimeError: the grader is broken"),
    ("blocks_the_loop", "blocking_sleep", "timeout", f"no result within reward.timeout_s={TIMEOUT_S}s"),
])
def test_a_misbehaving_reward_fails_only_its_own_sample(pool, others, fn, fault, kind, error):
    reward = _reward(fn, pool)
    threads = threading.active_count()
    started = time.monotonic()
    samples = reward.score(_batch(fault))
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert samples[0].reward_error is None and samples[2].reward_error is None
    assert error in samples[1].reward_error
    assert reward.failures == {kind: 1}
    assert threading.active_count() == threads
    _assert_only_pool_children(pool, others)


def test_a_group_reward_that_crashes_fails_only_its_group(pool, others):
    reward = _reward("misbehaves_per_group", pool, scope="group")
    crash = {"fault": "os_exit"}
    samples = _batch("os_exit") + [Sample(uid=9, group_id=1, response_text="no", label="42", metadata=crash)]
    reward.score(samples)
    assert [s.reward_error is None for s in samples] == [True, False, True, False]
    assert samples[1].reward_error == samples[3].reward_error  # one call for the whole group
    assert "exited with code 7" in samples[1].reward_error
    assert reward.failures == {"crash": 2}
    _assert_only_pool_children(pool, others)


def test_workers_stay_warm_and_a_timed_out_one_is_replaced(pool, others):
    reward = _reward("misbehaves", pool)
    before = set(pool.pids())
    reward.score(_batch(None))
    assert set(pool.pids()) == before  # reused, not restarted
    replaced = pool.replaced
    reward.score(_batch("gil_regex"))
    assert pool.replaced == replaced + 1
    assert len(set(pool.pids()) - before) == 1
    assert not set(pool.pids()) >= before  # the late worker is gone, killed and reaped
    _assert_only_pool_children(pool, others)


def test_a_killed_reward_takes_the_programs_it_started_with_it(pool):
    """The program is found by a marker in its command line (a confined reward cannot write a pid
    file where this test could read it)."""
    marker = f"rlx-reward-program-{uuid.uuid4().hex}"
    reward = Reward(build_reward(f"{ESCAPING}:starts_a_marked_program_and_hangs", "none"), timeout_s=3.0, pool=pool)
    sample = Sample(uid=0, group_id=0, response_text="x", label="x", metadata={"marker": marker})
    with ThreadPoolExecutor(1) as scoring:
        scored = scoring.submit(reward.score, [sample])
        deadline = time.monotonic() + 30
        while not _marked(marker):
            assert time.monotonic() < deadline, "the reward's program never started"
            time.sleep(0.05)
        [sample] = scored.result()
    assert "reward.timeout_s" in sample.reward_error
    deadline = time.monotonic() + 5
    while _marked(marker):
        assert time.monotonic() < deadline, "the reward's own program outlived the killed reward"
        time.sleep(0.1)


def _marked(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline", "status"])
            if marker in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]


def test_a_pool_process_ends_itself_after_its_deadline():
    """If the pool dies mid-call, its process still ends: a kernel alarm, even with the GIL held."""
    worker = _Worker()
    try:
        worker.answer(60, "the pool process did not start")
        spec = RewardSpec(f"{BAD}:misbehaves", "none", None, tuple(sys.path))
        worker.conn.send(("call", (spec, ("x", "x", {"fault": "gil_regex"})), 0.5))
        assert worker.proc.wait(timeout=30) == -signal.SIGALRM
    finally:
        worker.kill()


def test_close_stops_every_pool_process():
    reward = Reward(build_reward(f"{BAD}:misbehaves", "none"), timeout_s=10, pool_size=2)
    reward.score(_batch(None))
    pids = reward._pool.pids()  # the role's own pool, to check that its processes end
    assert pids
    reward.close()
    assert not {c.pid for c in psutil.Process().children()} & set(pids)  # ended and reaped
    assert reward.score(_batch(None))[0].reward == 1.0  # a closed role starts a new pool when it scores again
    reward.close()


def test_a_backtracking_format_pattern_times_out_in_the_pool(pool, others):
    """reward.format_pattern is user input too: a catastrophic regex fails its sample, not the run."""
    reward = Reward(build_reward("format", "none", r"(a+)+$"), timeout_s=TIMEOUT_S, pool=pool)
    samples = [Sample(uid=0, group_id=0, response_text="aaaa"),
               Sample(uid=1, group_id=1, response_text="a" * 40 + "b")]
    started = time.monotonic()
    reward.score(samples)
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert samples[0].reward == 1.0 and samples[0].reward_error is None
    assert "reward.timeout_s" in samples[1].reward_error
    _assert_only_pool_children(pool, others)


def _escapes(pool: RewardPool, fn: str, metadata: dict) -> Sample:
    reward = Reward(build_reward(f"{ESCAPING}:{fn}", "none"), timeout_s=10.0, pool=pool)
    [sample] = reward.score([Sample(uid=0, group_id=0, response_text="x", label="x", metadata=metadata)])
    return sample


def test_a_reward_can_write_nothing_of_the_host(pool, tmp_path):
    """Each worker is confined once, as it starts: the host is read-only where it is visible at all
    (the working directory, on the import path), and /tmp is the worker's own."""
    for folder in (Path(tempfile.mkdtemp(dir=os.getcwd(), prefix=".rlx-test-")), tmp_path):
        folder.chmod(0o777)  # the permissions allow it: only the confinement stops it
        try:
            sample = _escapes(pool, "writes_a_file", {"path": str(folder / "escaped.txt")})
            assert sample.reward == 0.0 and sample.reward_error is not None
            assert "Read-only file system" in sample.reward_error or "No such file" in sample.reward_error
            assert list(folder.iterdir()) == []
        finally:
            if folder != tmp_path:
                folder.rmdir()


def test_a_reward_reaches_no_network(pool):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        sample = _escapes(pool, "connects", {"port": server.getsockname()[1]})
        with pytest.raises(TimeoutError):
            server.accept()
    assert "Network is unreachable" in sample.reward_error


def test_a_reward_holds_no_token_and_is_not_root(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    monkeypatch.setenv("RLX_API_TOKEN", "secret")
    with RewardPool(max_workers=1) as own:  # started with the tokens in this process's environment
        for variable in ("RAY_AUTH_TOKEN", "RLX_API_TOKEN"):
            sample = _escapes(own, "sees", {"variable": variable})
            assert (sample.reward, sample.reward_error) == (0.0, None)


def test_a_worker_reply_is_plain_data_of_bounded_size(pool, tmp_path):
    """A worker the model's text took over cannot reach the parent through its reply: a pickle that
    would call open() in the parent is refused, and a 2 MB reply is cut off (its worker killed)."""
    target = tmp_path / "opened-by-the-parent.txt"
    sample = _escapes(pool, "replies_with_code", {"path": str(target)})
    assert not target.exists()
    assert "io.open is not plain data" in sample.reward_error
    sample = _escapes(pool, "replies_at_length", {})
    assert "sent a reply over 1048576 bytes; it was killed" in sample.reward_error
    assert _escapes(pool, "sees", {"variable": "RAY_AUTH_TOKEN"}).reward == 0.0  # the pool serves on


def test_a_host_that_cannot_confine_refuses_pooled_rewards_unless_allowed(monkeypatch):
    """Stands in for a host without user namespaces (a container that blocks unshare): the probe's
    answer is injected. A reward that reads model text refuses to build, naming the switch; with the
    switch it runs in unconfined processes; rlx's own string matching needs no pool either way."""
    from rlx import rewards

    monkeypatch.setattr(rewards, "confinement_problem", lambda: "the process could not be confined (EPERM)")
    monkeypatch.setenv("RLX_API_TOKEN", "secret")
    with pytest.raises(ConfigError, match=r"could not be confined \(EPERM\).*reward\.allow_unconfined=true"):
        build_reward("reasoning_gym", "answer_tag")
    with pytest.raises(ConfigError, match="reward.allow_unconfined"):
        build_reward(f"{BAD}:misbehaves", "none")
    assert not isinstance(build_reward("exact_match", "none"), rewards.PooledReward)
    unconfined = build_reward(f"{ESCAPING}:sees", "none", allow_unconfined=True)
    assert unconfined.confined is False
    reward = Reward(unconfined, timeout_s=10.0, pool_size=1)
    try:
        [sample] = reward.score([Sample(uid=0, group_id=0, response_text="x", label="x",
                                        metadata={"variable": "RLX_API_TOKEN"})])
        assert (sample.reward, sample.reward_error) == (1.0, None)  # unconfined: it sees the token
    finally:
        reward.close()


def test_rlx_own_scorers_run_where_the_working_directory_is_not_visible():
    """A built-in scorer's pool sees the interpreter and rlx alone: the working directory (a checkout
    with its data, labels and runs) is not there, so user code from it cannot even be imported,
    while the same reward in a user reward's pool can (a red-team review read the labels there)."""
    reasoning = build_reward("reasoning_gym", "answer_tag")
    spy = RewardSpec(f"{ESCAPING}:sees", "none", None, tuple(sys.path))
    entry = {"source_dataset": "chain_sum"}
    with reasoning.new_pool(1) as own:
        assert own.call(reasoning.spec, ("<answer>3</answer>", "3", entry), 30.0) == 1.0
        with pytest.raises(RewardFailure, match="No module named 'tests"):
            own.call(spy, ("x", "x", {"variable": "HOME"}), 30.0)
    with build_reward(f"{ESCAPING}:sees", "none").new_pool(1) as users:
        assert users.call(spy, ("x", "x", {"variable": "RLX_NOT_SET"}), 30.0) == 0.0
