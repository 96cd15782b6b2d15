"""`gate.monitor.distributed`: one step's statistics reduced across real torch.distributed ranks (2 CPU processes
on gloo) equal one process's statistics of the same global batch bit for bit; ranks at different steps, with
different columns or too many timestep values, and a rank that never joins are errors on every rank that joined,
never merged figures. Every rank holds whole samples, interleaved as torch's DistributedSampler deals them."""

from __future__ import annotations

import json
import math
import os
import socket
import time
import warnings

import numpy as np
import pytest
import torch

from rollout_consistency.gate.monitor import MonitorError, MonitorSettings, RunMonitor, StepJudge
from rollout_consistency.gate.monitor.distributed import (
    LIMBS,
    DistributedMonitorError,
    pack_stats,
    reduce_step_stats,
    unpack,
)
from rollout_consistency.gate.monitor.exact_sum import ExactSum
from rollout_consistency.gate.monitor.figures import StepStats

N, T, SCHEDULE = 12, 4, 10
WORLD = 2
STEPS = (3, 4, 5)


def global_batch(step: int) -> dict[str, np.ndarray]:
    """The step's whole batch: float32 log-probs differing by ~1e-5, each sample's SDE window drawn at random
    (verl-omni: the timestep values differ per row), and at step 5 one NaN trainer entry (sample 7)."""
    rng = np.random.default_rng(step)
    rollout = rng.normal(-1.0, 0.2, (N, T)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, 1e-5, (N, T))).astype(np.float32)
    schedule = np.linspace(1000.0, 100.0, SCHEDULE, dtype=np.float32)
    starts = rng.integers(0, SCHEDULE - T + 1, N)
    timesteps = np.stack([schedule[s : s + T] for s in starts])
    if step == 5:
        trainer[7, 2] = np.nan
    return {"rollout": rollout, "trainer": trainer, "timesteps": timesteps}


def shard(batch: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    return {name: table[rank::WORLD] for name, table in batch.items()}


def stats_of(tables: dict[str, np.ndarray]) -> StepStats:
    return StepStats.from_tables(tables["rollout"], tables["trainer"], timesteps=tables["timesteps"], clip_ratio=1e-5)


SETTINGS = MonitorSettings(warmup_steps=2).replace(profile="kernel")


class Tracker:
    """A tracker in the shape of verl's ``Tracking``: ``log(data, step=)``, kept in memory."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, data, step):
        self.logged.append((step, dict(data)))


def monitor_steps(monitor: RunMonitor, rank: int | None) -> dict:
    """Each step's figures (bits) and verdict from `monitor` on this rank's shard (or the whole batch)."""
    out = {}
    for step in STEPS:
        batch = global_batch(step)
        tables = batch if rank is None else shard(batch, rank)
        verdict = monitor.observe(step, tables["rollout"], tables["trainer"], timesteps=tables["timesteps"])
        out[step] = {"figures": bits(monitor.last_figures), "verdict": verdict_text(verdict)}
    return out


def monitor_settings(directory) -> MonitorSettings:
    return SETTINGS.replace(clip_ratio=1e-5, on_alarm="stop", dump_dir=str(directory))


def verdict_text(verdict) -> str:
    return json.dumps(verdict.to_dict(), sort_keys=True)


def bits(figures) -> dict:
    """Every figure as float.hex (NaN included), per timestep too: equal dicts are equal bits."""
    return {
        "values": {name: float(value).hex() for name, value in figures.values.items()},
        "counts": [figures.entries, figures.samples, figures.nonfinite],
        "by_timestep": {
            float(t).hex(): {k: float(v).hex() for k, v in row.items()} for t, row in figures.by_timestep.items()
        },
    }


# ----------------------------------------------------------------------------------------------------
# Packing, without processes


def test_packed_statistics_come_back_exactly_whatever_their_size():
    """Sums near float64's top and bottom (1e300, subnormals), negative, and with an inf: unpacked equal."""
    rollout = np.array([[1e300, -1e300, 5e-324, 0.0], [-3.0, 1e-310, 2.5, -7.0]], dtype=np.float64)
    trainer = np.array([[-1e300, 1e300, -5e-324, np.inf], [4.0, -1e-310, -2.5, 7.0]], dtype=np.float64)
    timesteps = np.array([[900.0, 800.0, 700.0, 600.0], [900.0, 800.0, 700.0, 600.0]])
    stats = StepStats.from_tables(rollout, trainer, timesteps=timesteps)
    big = max(abs(s.numerator) for s in [*stats.sums.values(), stats.abs_delta])
    assert big.bit_length() > 2000  # the limbs carry a numerator of over 2000 bits
    packed = pack_stats(stats, step=9, rank=0, world=1, shape=(2, 4), slots=4)
    assert packed.dtype == np.int64
    again = unpack([packed], expected_world=1, sum_names=list(stats.sums))
    assert again == stats
    # The length depends only on the slots: every rank sends the same size without asking.
    other = StepStats.from_tables(rollout[:1], trainer[:1])
    assert pack_stats(other, step=9, rank=0, world=1, shape=(1, 4), slots=4).size == packed.size
    assert LIMBS * 64 > 1128 + 1024 + 63


def test_a_sum_too_wide_for_the_limbs_is_refused_not_wrapped():
    wide = StepStats.from_tables(np.zeros((1, 1)), np.ones((1, 1)))
    wide = StepStats(**{**vars(wide), "abs_delta": ExactSum(1 << (64 * LIMBS))})
    with pytest.raises(DistributedMonitorError, match="wider than the packed limbs"):
        pack_stats(wide, step=0, rank=0, world=1, shape=(1, 1), slots=1)


def test_without_a_process_group_the_stats_are_returned_as_they_are():
    stats = stats_of(global_batch(3))
    assert reduce_step_stats(stats, step=3, shape=(N, T)) is stats


def test_headers_that_disagree_are_refused_naming_the_ranks():
    batch = global_batch(3)
    parts = [stats_of(shard(batch, r)) for r in range(WORLD)]
    names = list(parts[0].sums)

    def packed(rank, **change):
        options = {"step": 3, "rank": rank, "world": WORLD, "shape": (N // WORLD, T), "slots": 16} | change
        return pack_stats(parts[rank], **options)

    merged = unpack([packed(0), packed(1)], expected_world=WORLD, sum_names=names)
    assert bits(merged.figures()) == bits(stats_of(batch).figures())
    for arrays, message in (
        ([packed(0), packed(1, step=4)], r"different steps \(rank 0 at step 3, rank 1 at step 4\)"),
        ([packed(0), packed(1, shape=(6, 5))], r"different numbers of columns \(rank 0 has \(6, 4\), rank 1 has"),
        ([packed(0), packed(1, world=3)], "disagree on the world size"),
        ([packed(0), packed(0)], "expected ranks 0..1, got ranks 0, 0"),
        ([packed(0)], "expected ranks 0..1, got ranks 0"),
        ([packed(0, slots=2), packed(1, slots=2)], r"rank 0 has \d+, rank 1 has \d+ timestep values, more than the 2"),
    ):
        with pytest.raises(DistributedMonitorError, match=message):
            unpack(arrays, expected_world=WORLD, sum_names=names)


# ----------------------------------------------------------------------------------------------------
# Two processes on gloo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attempt(call) -> dict:
    try:
        return {"figures": bits(call().figures())}
    except DistributedMonitorError as error:
        return {"error": str(error)}


def _rank_main(rank: int, world: int, port: int, directory: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    judge = StepJudge(SETTINGS)
    try:
        for step in STEPS:  # a clean run: every rank at every step
            tables = shard(global_batch(step), rank)
            merged = reduce_step_stats(stats_of(tables), step=step, shape=tables["trainer"].shape, timeout_s=60)
            results[f"step {step}"] = {"figures": bits(merged.figures())}
            # every rank holds the same bits, so every rank's judge reaches rank 0's verdict (no second collective)
            results[f"verdict {step}"] = verdict_text(judge.judge(step, merged.figures()))
        # the run monitor with distributed=True: one reduction per step, the verdict of the global batch
        tracker = Tracker()
        monitor = RunMonitor(
            monitor_settings(os.path.join(directory, "dumps")).replace(distributed=True, reduce_timeout_s=2),
            log_to=tracker,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results["monitor"] = monitor_steps(monitor, rank)
        results["monitor warnings"] = len(caught)
        results["monitor logged steps"] = [step for step, _ in tracker.logged]
        results["monitor alarm steps"] = [record.step for record in monitor.alarm_records]
        results["monitor should stop"] = monitor.should_stop
        results["monitor passed"] = monitor.summary().passed
        tables = shard(global_batch(3), rank)
        stats = stats_of(tables)
        # rank 1 skipped a step: it is one ahead
        results["steps differ"] = _attempt(lambda: reduce_step_stats(stats, step=6 + rank, shape=(6, T)))
        results["columns differ"] = _attempt(lambda: reduce_step_stats(stats, step=7, shape=(6, T + rank)))
        results["too many timesteps"] = _attempt(
            lambda: reduce_step_stats(stats, step=8, shape=(6, T), max_timesteps=2)
        )
        # a missing rank: rank 1 never calls the run monitor at step 9 (it hangs elsewhere, then leaves)
        if rank == 0:
            started = time.monotonic()
            try:
                monitor.observe(9, tables["rollout"], tables["trainer"], timesteps=tables["timesteps"])
                results["missing rank"] = {"figures": bits(monitor.last_figures)}
            except DistributedMonitorError as error:
                results["missing rank"] = {"error": str(error)}
            results["missing rank waited s"] = time.monotonic() - started
        else:
            time.sleep(5)
    finally:
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)
    os._exit(0)  # the group is broken after the missing rank: leave without a barrier


def run_ranks(directory, deadline_s: float = 120.0) -> list[dict]:
    """Start the ranks; kill them all if they are not done by the deadline (a hang must not hang the suite)."""
    context = torch.multiprocessing.start_processes(
        _rank_main, args=(WORLD, _free_port(), str(directory)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {deadline_s} s")
    results = []
    for rank in range(WORLD):
        with open(os.path.join(directory, f"rank{rank}.json")) as handle:
            results.append(json.load(handle))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One run of the 2 ranks (the spawn is most of the time), shared by the tests that read it."""
    directory = tmp_path_factory.mktemp("ranks")
    return directory, run_ranks(directory)


def test_two_gloo_ranks_give_the_single_process_figures_bit_for_bit_and_fail_closed(ranks):
    _, results = ranks
    judge = StepJudge(SETTINGS)
    for step in STEPS:
        whole = stats_of(global_batch(step)).figures()
        reference, verdict = bits(whole), verdict_text(judge.judge(step, whole))
        for rank in range(WORLD):
            assert results[rank][f"step {step}"] == {"figures": reference}, (rank, step)
            assert results[rank][f"verdict {step}"] == verdict, (rank, step)
    assert '"kind": "nonfinite"' in results[0]["verdict 5"]
    assert results[0]["step 5"]["figures"]["counts"][2] == 1  # sample 7's NaN (rank 1's shard) is counted
    assert math.isnan(float.fromhex(results[0]["step 5"]["figures"]["values"]["mean_abs_dlogp"]))
    assert len(results[0]["step 3"]["figures"]["by_timestep"]) > T  # windows per sample: more values than columns
    for case, message in (
        ("steps differ", "the ranks are at different steps (rank 0 at step 6, rank 1 at step 7)"),
        ("columns differ", "step 7: the ranks' tables have different numbers of columns"),
        ("too many timesteps", "step 8: rank 0 has"),
    ):
        for rank in range(WORLD):
            assert "figures" not in results[rank][case]
            assert message in results[rank][case]["error"], (rank, case)
    assert "figures" not in results[0]["missing rank"]
    assert (
        "step 9: not every one of the 2 ranks joined the monitor's reduction within 2 s"
        in results[0]["missing rank"]["error"]
    )
    assert results[0]["missing rank waited s"] < 30


def test_run_monitor_across_two_gloo_ranks_judges_the_global_batch_on_rank_0_and_stops_every_rank(ranks, tmp_path):
    """`RunMonitor(distributed=True)` on each rank's shard: every rank gets the figures and verdicts one monitor
    gives on the whole batch (bit for bit); rank 1's planted NaN (step 5) alarms at step 5; rank 0 alone logs and
    warns; every rank stops and dumps its shard. (The same ranks' run: `test_two_gloo_ranks...`.)"""
    directory, results = ranks
    single = RunMonitor(monitor_settings(tmp_path / "single"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = monitor_steps(single, None)
    assert [r.step for r in single.alarm_records] == [5]
    for rank in range(WORLD):
        assert results[rank]["monitor"] == {str(step): reference[step] for step in STEPS}, rank
        assert results[rank]["monitor alarm steps"] == [5], rank
        assert results[rank]["monitor should stop"] is True, rank  # stop acts on every rank together
        assert results[rank]["monitor passed"] is False, rank
    assert results[0]["monitor logged steps"] == list(STEPS)
    assert results[1]["monitor logged steps"] == []
    assert results[0]["monitor warnings"] == 1 and results[1]["monitor warnings"] == 0
    dumps = sorted(p.name for p in (directory / "dumps").iterdir())
    assert dumps == ["monitor-step00000005-rank0.safetensors", "monitor-step00000005-rank1.safetensors"]


def test_distributed_without_a_process_group_is_refused(tmp_path):
    monitor = RunMonitor(distributed=True)
    batch = global_batch(3)
    with pytest.raises(MonitorError, match=r"torch\.distributed has no process group: call"):
        monitor.observe(3, batch["rollout"], batch["trainer"])
    with pytest.raises(MonitorError, match="process_group given without distributed=True"):
        RunMonitor(process_group=object())
