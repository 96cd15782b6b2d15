# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Run the check's shards on Ray workers, or in this process — same function, same results.

[`run_sharded`] takes two plain functions: ``setup() -> state`` builds what a worker holds (a backend with
its model) and ``work(state, shard) -> result`` does one shard. In-process they are called directly; on Ray
each worker is an actor that calls ``setup`` once and then ``work`` for each shard it is given. Results come
back in shard order whatever the order of completion, so a caller that aggregates them in that order gets
the figures a single process would get — provided that what ``work`` computes depends only on the shard
(explicit seeds, prompt groups, whole rollout batches), never on which worker or how many.

Placement: each actor asks for one GPU when the cluster has one per worker (a fraction otherwise), else
for a share of the CPUs (at most one); torch in the actor runs on that many threads (at least 1).

Failure policy: a worker that dies (process killed, crashed, OOM) is replaced and its shard retried once;
a second death records a [`ShardFailure`] naming the shard, and the caller fails the check. An exception
raised by ``work`` or ``setup`` is a bug or a usage error, not a dead worker: it is raised to the caller.

Ray session: an initialised Ray session is reused (tests start one per session); ``ray_address`` joins a
cluster; otherwise a local cluster is started with its files under a fresh temporary directory and shut
down afterwards. Without Ray installed the shards run in-process and a note says so.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rollout_consistency.safeguards.fence import UserCodeExit, UserCodeTimeout
from rollout_consistency.safeguards.supervisor import announce_temp

from .ray_connect import DistributedError, check_reachable

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

RAY_MISSING_NOTE = (
    "Ray is not installed, so the shards ran one after another in this process "
    "(pip install 'rollout-consistency[ray]' to distribute them)."
)

#: Tries per shard when its worker dies: the first, and one retry (the failure policy above).
MAX_ATTEMPTS = 2
#: Longest temp-dir base under which Ray's socket paths stay within the 107-byte AF_UNIX limit.
RAY_TEMP_BASE_MAX = 26


@dataclass(frozen=True)
class ShardFailure:
    """A shard whose worker died on every attempt."""

    shard: int
    attempts: int
    error: str

    def describe(self) -> str:
        return f"shard {self.shard} failed after {self.attempts} attempt(s): worker died ({self.error})"


@dataclass(frozen=True)
class ShardedResults(Generic[R]):
    """Results of [`run_sharded`], in shard order (``None`` where the shard failed).

    Attributes:
        results: one entry per shard.
        failures: shards whose worker died twice.
        mode: ``"in-process"`` or ``"ray"``.
        workers: workers actually used.
        notes: things the caller should tell the user (Ray missing, joined an existing session, ...).
        timings_s: ``startup`` (Ray start and worker setup; 0 in-process), ``setup`` (in-process setup) and
            ``work`` (first shard submitted to last result), in seconds.
    """

    results: tuple[R | None, ...]
    failures: tuple[ShardFailure, ...] = ()
    mode: str = "in-process"
    workers: int = 1
    notes: tuple[str, ...] = ()
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def run_sharded(
    work: Callable[[S, T], R],
    shards: Sequence[T],
    *,
    setup: Callable[[], S],
    workers: int = 1,
    use_ray: bool | None = None,
    ray_address: str | None = None,
    on_result: Callable[[int, R], None] | None = None,
    ray_timeout_s: float = 30.0,
) -> ShardedResults[R]:
    """Run ``work(state, shard)`` for every shard, with ``state = setup()`` once per worker.

    Args:
        work: plain, picklable function of (worker state, shard); must not depend on the worker.
        shards: the units of work, in the order results are returned.
        setup: plain, picklable function building a worker's state (e.g. the backend and its model).
        workers: number of Ray actors (capped at the number of shards).
        use_ray: ``True`` requires Ray, ``False`` runs in-process, ``None`` requires Ray when a `ray_address`
            is given and uses it when `workers` > 1 and Ray is installed (in-process with a note otherwise).
        ray_address: a Ray cluster to join (``"auto"`` or ``"ray://host:10001"``); a local one otherwise.
        on_result: called as ``on_result(shard_index, result)`` as each shard completes (progress bars).
        ray_timeout_s: seconds to reach `ray_address` before raising DistributedError (Ray itself would
            retry for minutes).

    Raises:
        DistributedError: Ray is required (`use_ray=True` or `ray_address`) but not installed, or a worker's
            `setup` failed.
        Exception: whatever `work` raised (a bug or usage error is not retried).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}.")
    have_ray = ray_available()
    if use_ray is False and ray_address is not None:
        raise ValueError(f"ray_address {ray_address!r} names a Ray cluster, but use_ray=False runs in this process.")
    if use_ray is None:
        # A cluster was named: it is joined or the run stops. Running in-process instead would pass a check
        # that never ran where the user asked (only more workers without an address fall back, with a note).
        use_ray = ray_address is not None or (have_ray and workers > 1)
    if use_ray and not have_ray:
        raise DistributedError(
            "Ray is required for --ray-address / use_ray=True but is not installed: "
            "pip install 'rollout-consistency[ray]'."
        )
    if not shards:
        return ShardedResults(results=(), mode="ray" if use_ray else "in-process", workers=0)
    if not use_ray:
        notes = (RAY_MISSING_NOTE,) if workers > 1 and not have_ray else ()
        return _run_in_process(work, shards, setup, on_result, notes)
    if ray_address is not None:
        check_reachable(ray_address, ray_timeout_s)
    return _run_on_ray(work, shards, setup, min(workers, len(shards)), ray_address, on_result)


# ----------------------------------------------------------------------------------------------------
def _run_in_process(work, shards, setup, on_result, notes) -> ShardedResults:
    start = time.perf_counter()
    state = setup()
    setup_s = time.perf_counter() - start
    results = []
    start = time.perf_counter()
    for index, shard in enumerate(shards):
        result = work(state, shard)
        results.append(result)
        if on_result is not None:
            on_result(index, result)
    return ShardedResults(
        results=tuple(results),
        mode="in-process",
        workers=1,
        notes=tuple(notes),
        timings_s={"startup": 0.0, "setup": setup_s, "work": time.perf_counter() - start},
    )


class _ShardWorker:
    """Ray actor body: holds one worker state built by `setup`."""

    def __init__(self, setup: Callable[[], Any], threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self._state = setup()

    def ready(self) -> int:
        return os.getpid()

    def run(self, work: Callable[[Any, Any], Any], shard: Any) -> Any:
        return work(self._state, shard)


def _placement(ray: Any, workers: int) -> tuple[dict[str, float], int]:
    resources = ray.cluster_resources()
    gpus, cpus = float(resources.get("GPU", 0.0)), float(resources.get("CPU", 1.0))
    if gpus >= 1:
        share = min(1.0, gpus / workers)
        return {"num_gpus": share, "num_cpus": min(1.0, cpus / workers)}, max(1, int(cpus // workers))
    share = min(1.0, cpus / workers)
    return {"num_cpus": share, "num_gpus": 0}, max(1, int(share))


def _start_ray(ray: Any, ray_address: str | None) -> tuple[bool, str | None, tuple[str, ...]]:
    """(started here, temp dir to remove, notes)."""
    if ray.is_initialized():
        return False, None, ()
    if ray_address is not None:
        try:
            ray.init(address=ray_address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
            ray.shutdown()
            raise DistributedError(
                f"cannot join the Ray cluster at {ray_address!r} ({_first_line(error)}); start it (`ray start "
                f"--head`) or fix --ray-address."
            ) from error
        return True, None, (f"joined the Ray cluster at {ray_address}",)
    # Ray puts AF_UNIX sockets under its temp dir, and a socket path may not exceed 107 bytes, about 81 of
    # which are ours and Ray's (rc-ray-*/session_<date>_<pid>/sockets/plasma_store): a long TMPDIR (pytest's,
    # macOS's, a CI workspace's) would make the start fail, so such a start goes under /tmp.
    base = tempfile.gettempdir()
    temp_dir = tempfile.mkdtemp(prefix="rc-ray-", dir=base if len(base) <= RAY_TEMP_BASE_MAX else "/tmp")
    announce_temp(temp_dir)  # the supervisor removes it if this process is killed
    try:
        ray.init(
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            _temp_dir=temp_dir,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except BaseException:  # Ctrl-C during start-up: no Ray processes, no temp directory left behind
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return True, temp_dir, ()


def _run_on_ray(work, shards, setup, workers, ray_address, on_result) -> ShardedResults:
    import ray
    from ray.exceptions import RayActorError

    t0 = time.perf_counter()
    started, temp_dir, start_notes = _start_ray(ray, ray_address)
    notes = list(start_notes)
    try:
        options, threads = _placement(ray, workers)
        actor_class = ray.remote(_ShardWorker).options(max_restarts=0, max_task_retries=0, **options)

        def new_actor() -> Any:
            return actor_class.remote(setup, threads)

        actors = [new_actor() for _ in range(workers)]
        try:
            ray.get([a.ready.remote() for a in actors])
        except RayActorError as error:
            raise _setup_failure(error) from error
        startup_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        results: list[Any] = [None] * len(shards)
        attempts = [0] * len(shards)
        failures: list[ShardFailure] = []
        pending = list(range(len(shards)))
        idle = list(actors)
        running: dict[Any, tuple[int, Any]] = {}
        while pending or running:
            while pending and idle:
                index, actor = pending.pop(0), idle.pop(0)
                attempts[index] += 1
                running[actor.run.remote(work, shards[index])] = (index, actor)
            done, _ = ray.wait(list(running), num_returns=1)
            index, actor = running.pop(done[0])
            try:
                result = ray.get(done[0])
            except RayActorError as error:
                if getattr(error, "actor_init_failed", False):
                    raise _setup_failure(error) from error
                ray.kill(actor, no_restart=True)
                if attempts[index] < MAX_ATTEMPTS:
                    pending.insert(0, index)
                    # Named in the report: a retry can hide a flaky node or an OOM the user should know about.
                    notes.append(
                        f"shard {index} was retried on a new worker after its worker died on attempt "
                        f"{attempts[index]} ({_first_line(error)})"
                    )
                else:
                    failures.append(ShardFailure(index, attempts[index], _first_line(error)))
                if pending or running:
                    idle.append(new_actor())
                continue
            results[index] = result
            idle.append(actor)
            if on_result is not None:
                on_result(index, result)
        for actor in idle:
            ray.kill(actor, no_restart=True)
        return ShardedResults(
            results=tuple(results),
            failures=tuple(sorted(failures, key=lambda f: f.shard)),
            mode="ray",
            workers=workers,
            notes=tuple(notes),
            timings_s={"startup": startup_s, "setup": 0.0, "work": time.perf_counter() - t1},
        )
    finally:
        if started:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _setup_failure(error: BaseException) -> Exception:
    """The error to raise for a worker whose setup failed: Ray hands back only the actor's traceback as text, whose
    last line is the exception; user code that ended or overran its call stays that usage error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    last = lines[-1] if lines else type(error).__name__
    name, sep, message = last.partition(": ")
    for kind in (UserCodeExit, UserCodeTimeout):
        if sep and name.endswith("." + kind.__name__):
            return kind(message)
    return DistributedError(f"a Ray worker could not start (its setup failed): {last[:500]}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
