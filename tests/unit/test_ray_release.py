"""What rlx refuses before it starts Ray: a release whose Serve replicas take unauthenticated calls
(N2), and a session directory another user could read or swap (L7). No cluster starts here."""

from __future__ import annotations

import os
import stat

import pytest
import ray

from rlx.errors import ConfigError
from rlx.orchestration.cluster import ray_release, ray_temp_dir, require_safe_ray, start_ray


def test_versions_compare_by_release():
    assert ray_release("2.60.0") == (2, 60)
    assert ray_release("2.59.1") < (2, 60) <= ray_release("3.0.0.dev0")
    assert ray_release("2.61rc1") == (2, 61)


def test_a_ray_before_the_serve_grpc_fix_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(ray, "__version__", "2.59.0")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"Ray 2\.59\.0 is installed.*ray\[serve\]>=2\.60.*"
                                          r"resources\.ray_allow_unauthenticated=true"):
        start_ray(num_cpus=1)
    require_safe_ray(allow_unauthenticated=True)  # the explicit opt-out runs on it

def test_the_installed_ray_has_the_fix():
    assert ray_release(ray.__version__) >= (2, 60)


def test_ray_session_files_live_in_a_directory_of_this_user_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir reads TMPDIR afresh
    made = ray_temp_dir()
    assert made.parent == tmp_path and stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o777)
    assert stat.S_IMODE(ray_temp_dir().stat().st_mode) == 0o700  # tightened when found open
    made.rmdir()
    (tmp_path / "elsewhere").mkdir()
    made.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="not a directory of this user's"):
        ray_temp_dir()
    if os.getuid() == 0:  # another user's directory under the same name
        made.unlink()
        made.mkdir()
        os.chown(made, 65534, 65534)
        with pytest.raises(RuntimeError, match="not a directory of this user's"):
            ray_temp_dir()
