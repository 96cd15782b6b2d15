"""rollout_consistency.gate.sides.distributed: shard order, in-process equivalence, dead workers (real Ray, one session)."""

from __future__ import annotations

import os
import sys

import pytest

from rollout_consistency.gate.sides.distributed import DistributedError, run_sharded


def _setup():
    return {"scale": 3, "pid": os.getpid()}


def _work(state, shard):
    # Depends on the shard only; the pid is returned separately to show where it ran.
    return {"values": [state["scale"] * x for x in shard["items"]], "pid": os.getpid()}


def _die_on(state, shard):
    """Kill the worker process (a real crash, not an exception) as the shard says."""
    marker = shard.get("die_once_marker")
    if shard.get("always_die") or (marker is not None and not os.path.exists(marker)):
        if marker is not None:
            open(marker, "w").close()
        os._exit(17)
    return sum(shard["items"])


def _raise(state, shard):
    raise ValueError(f"bad shard {shard['items']}")


def _bad_setup():
    raise FileNotFoundError("no model at /nonexistent")


def _shards(n):
    return [{"items": list(range(i * 3, i * 3 + 3))} for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _pickle_this_module_by_value():
    """Ray workers cannot import test modules; ship these helper functions by value instead."""
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_in_process_runs_every_shard_in_order():
    seen = []
    out = run_sharded(_work, _shards(4), setup=_setup, workers=1, on_result=lambda i, r: seen.append(i))
    assert out.mode == "in-process" and out.ok
    assert [r["values"] for r in out.results] == [[3 * x for x in range(i * 3, i * 3 + 3)] for i in range(4)]
    assert seen == [0, 1, 2, 3]
    assert {r["pid"] for r in out.results} == {os.getpid()}


def test_ray_results_match_in_process_for_one_and_two_workers(ray_session):
    reference = [r["values"] for r in run_sharded(_work, _shards(5), setup=_setup, use_ray=False).results]
    for workers in (1, 2):
        out = run_sharded(_work, _shards(5), setup=_setup, workers=workers, use_ray=True)
        assert out.mode == "ray" and out.workers == workers and out.ok
        assert [r["values"] for r in out.results] == reference
        assert os.getpid() not in {r["pid"] for r in out.results}
    assert out.timings_s["startup"] > 0


def test_dead_worker_is_retried_once_and_then_succeeds(ray_session, tmp_path):
    shards = _shards(3)
    shards[1]["die_once_marker"] = str(tmp_path / "died")
    out = run_sharded(_die_on, shards, setup=_setup, workers=2, use_ray=True)
    assert out.ok
    assert list(out.results) == [sum(s["items"]) for s in shards]
    assert (tmp_path / "died").exists()  # it really died once
    assert any("shard 1 was retried" in note for note in out.notes)  # the retry is named in the report


def test_worker_that_dies_twice_fails_naming_the_shard(ray_session):
    shards = _shards(3)
    shards[2]["always_die"] = True
    out = run_sharded(_die_on, shards, setup=_setup, workers=2, use_ray=True)
    assert not out.ok
    assert [(f.shard, f.attempts) for f in out.failures] == [(2, 2)]
    assert "shard 2" in out.failures[0].describe()
    assert out.results[0] == sum(shards[0]["items"]) and out.results[2] is None


def test_exceptions_in_work_propagate_and_are_not_retried(ray_session):
    with pytest.raises(ValueError, match="bad shard"):
        run_sharded(_raise, _shards(2), setup=_setup, workers=2, use_ray=True)


def test_failed_setup_is_a_clear_error(ray_session):
    with pytest.raises(DistributedError, match="setup failed"):
        run_sharded(_work, _shards(2), setup=_bad_setup, workers=1, use_ray=True)


def test_bad_worker_count():
    with pytest.raises(ValueError, match="workers"):
        run_sharded(_work, _shards(1), setup=_setup, workers=0)
