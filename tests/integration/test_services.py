"""The run's services start, report and stop by PID; a service that fails says why in a line."""

import os
import sys

import pytest

from dspark.errors import ResourceError
from dspark.infra import services
from dspark.infra.spec import ClusterSpec


def _spec(**svc):
    return ClusterSpec.model_validate(
        {
            "name": "t",
            "kind": "local",
            "nodes": [{"name": "local", "role": "both"}],
            "services": svc,
        }
    )


def test_master_up_status_down(tmp_path):
    state = tmp_path / "state.json"
    wanted = services.wanted(_spec(mooncake_master=True), tracking_uri="sqlite://")
    assert [s.name for s in wanted] == ["mooncake-master"]
    first = services.up(wanted, state, tmp_path / "logs")
    pid = first["mooncake-master"]["pid"]
    again = services.up(wanted, state, tmp_path / "logs")  # running: left alone
    assert again["mooncake-master"]["pid"] == pid
    st = services.status(state)["mooncake-master"]
    assert st["alive"] and st["listening"]
    assert services.down(state) == ["mooncake-master"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert services.status(state) == {}


def test_a_service_that_dies_is_reported_and_nothing_is_left(tmp_path):
    state = tmp_path / "state.json"
    bad = services.Service(
        "broken",
        [sys.executable, "-c", "print('no port for you'); raise SystemExit(3)"],
        "127.0.0.1",
        1,
    )
    with pytest.raises(ResourceError, match=r"services: broken did not come up .*no port for you"):
        services.up([bad], state, tmp_path / "logs", timeout=10)
    assert services.status(state) == {}


def test_mlflow_and_prefect_worker_are_planned_when_asked():
    wanted = services.wanted(
        _spec(mooncake_master=False, mlflow_port=5055, prefect_pool="p"),
        tracking_uri="sqlite:///mlflow.db",
    )
    by_name = {s.name: s for s in wanted}
    assert by_name["mlflow"].port == 5055 and "sqlite:///mlflow.db" in by_name["mlflow"].argv
    assert by_name["prefect-worker"].argv[-3:] == ["serve", "--pool", "p"]
