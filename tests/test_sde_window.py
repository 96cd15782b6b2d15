"""SDE windows: pure functions of explicit arguments, shared by a prompt group, placement-independent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_consistency.schedulers import SDEWindow, SDEWindowSchedule, draw_sde_window

RUN = dict(num_steps=16, window_size=3, window_range=(0, 8))


def windows_for_run(seed: int, steps: int, groups: list[int]) -> dict[tuple[int, int], tuple[int, int]]:
    return {
        (step, group): (w.start, w.size)
        for step in range(steps)
        for group in groups
        for w in [draw_sde_window(seed=seed, global_step=step, prompt_group=group, **RUN)]
    }


def test_same_arguments_same_window_every_call():
    first = draw_sde_window(seed=7, global_step=3, prompt_group=11, **RUN)
    assert all(draw_sde_window(seed=7, global_step=3, prompt_group=11, **RUN) == first for _ in range(20))


#: Windows drawn once and written down: (seed, global_step, prompt_group, num_steps, window_size, window_range) ->
#: start. The draw is SHA-256 over the arguments packed as little-endian signed 64-bit integers, so these are the
#: starts on every platform, Python and process; a change to the key (its order, packing or prefix) moves them.
PINNED_WINDOWS = [
    ((0, 0, 0, 16, 3, None), 9),
    ((7, 3, 11, 16, 3, (0, 8)), 1),
    ((-1, 0, 5, 10, 2, None), 4),
    ((1234, 99, 3, 40, 4, (5, 30)), 16),
    ((2**63 - 1, 2**63 - 1, 2**63 - 1, 1000, 1, None), 402),
    ((-(2**63), 1, 2, 50, 10, None), 15),
]
#: seed 42, 16 steps, window 3: starts for global steps 0..2 (outer) x prompt groups 0..3 (inner).
PINNED_RUN = [8, 4, 5, 12, 7, 6, 12, 1, 9, 12, 9, 1]


def test_drawn_windows_are_pinned():
    for (seed, step, group, num_steps, size, window_range), start in PINNED_WINDOWS:
        window = draw_sde_window(
            seed=seed,
            global_step=step,
            prompt_group=group,
            num_steps=num_steps,
            window_size=size,
            window_range=window_range,
        )
        assert (window.start, window.size, window.num_steps) == (start, size, num_steps), (seed, step, group)
    run = [
        draw_sde_window(seed=42, global_step=step, prompt_group=group, num_steps=16, window_size=3).start
        for step in range(3)
        for group in range(4)
    ]
    assert run == PINNED_RUN
    schedule = SDEWindowSchedule("random", num_steps=16, window_size=3)
    assert schedule.window(seed=42, global_step=2, prompt_group=3).start == PINNED_RUN[-1]


def test_same_window_in_another_process():
    code = (
        "import json; from schedulers import draw_sde_window as d;"
        "print(json.dumps([[d(seed=7, global_step=s, prompt_group=g, num_steps=16, window_size=3,"
        " window_range=(0, 8)).start for g in range(6)] for s in range(5)]))"
    )
    # A different hash seed and rank variables in the child: neither may move the window.
    env = {"PYTHONHASHSEED": "12345", "RANK": "5", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "PATH": ""}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    here = [[draw_sde_window(seed=7, global_step=s, prompt_group=g, **RUN).start for g in range(6)] for s in range(5)]
    assert json.loads(child.stdout) == here


def test_rollouts_of_a_group_share_the_window():
    # 4 prompt groups × 8 rollouts each, requests interleaved as a server would see them.
    requests = [(request_id, request_id % 4) for request_id in range(32)]
    by_group: dict[int, set] = {}
    for _, group in requests:
        by_group.setdefault(group, set()).add(draw_sde_window(seed=1, global_step=0, prompt_group=group, **RUN))
    assert all(len(windows) == 1 for windows in by_group.values())


@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("split", ["contiguous", "strided"])
def test_run_windows_identical_whatever_the_rank_split(world_size, split):
    groups = list(range(16))
    reference = windows_for_run(seed=99, steps=6, groups=groups)
    merged: dict = {}
    for rank in range(world_size):
        if split == "contiguous":
            share = len(groups) // world_size
            mine = groups[rank * share : (rank + 1) * share]
        else:
            mine = groups[rank::world_size]
        merged.update(windows_for_run(seed=99, steps=6, groups=mine))
    assert merged == reference


def test_environment_is_never_read(monkeypatch):
    before = windows_for_run(seed=3, steps=4, groups=list(range(5)))
    for name, value in {"RANK": "7", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "PYTHONHASHSEED": "0"}.items():
        monkeypatch.setenv(name, value)
    assert windows_for_run(seed=3, steps=4, groups=list(range(5))) == before


def test_windows_vary_with_each_explicit_argument():
    base = dict(seed=0, global_step=0, prompt_group=0)
    starts = {
        name: {draw_sde_window(**{**base, name: value}, **RUN).start for value in range(50)}
        for name in ("seed", "global_step", "prompt_group")
    }
    assert all(len(values) > 1 for values in starts.values())


@settings(max_examples=60, deadline=None)
@given(
    num_steps=st.integers(1, 50),
    data=st.data(),
    seed=st.integers(-(2**40), 2**40),
    step=st.integers(0, 10**6),
    group=st.integers(0, 10**6),
)
def test_window_always_inside_range(num_steps, data, seed, step, group):
    low = data.draw(st.integers(0, num_steps - 1))
    high = data.draw(st.integers(low + 1, num_steps))
    size = data.draw(st.integers(1, high - low))
    window = draw_sde_window(
        seed=seed,
        global_step=step,
        prompt_group=group,
        num_steps=num_steps,
        window_size=size,
        window_range=(low, high),
    )
    assert low <= window.start and window.stop <= high and window.size == size


def test_every_start_is_reachable_and_roughly_uniform():
    counts = [0] * 6  # range (0, 8) with size 3 → starts 0..5
    for group in range(3000):
        counts[draw_sde_window(seed=5, global_step=1, prompt_group=group, **RUN).start] += 1
    assert min(counts) > 400 and max(counts) < 600


def test_schedules():
    fixed = SDEWindowSchedule("fixed", num_steps=10, window_size=2, window_range=(1, 6))
    assert {fixed.window(seed=0, global_step=s, prompt_group=g) for s in range(5) for g in range(5)} == {
        SDEWindow(1, 2, 10)
    }
    random_schedule = SDEWindowSchedule("random", num_steps=16, window_size=3, window_range=(0, 8))
    assert random_schedule.window(seed=4, global_step=2, prompt_group=9) == draw_sde_window(
        seed=4, global_step=2, prompt_group=9, **RUN
    )
    sliding = SDEWindowSchedule("progressive", num_steps=10, window_size=3, window_range=(0, 8), stride=2, every=3)
    starts = [sliding.window(seed=0, global_step=s, prompt_group=0).start for s in range(12)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 5, 5, 5]  # stops at high - size = 5


def test_window_membership():
    window = SDEWindow(start=2, size=3, num_steps=10)
    assert list(window.steps) == [2, 3, 4] and 4 in window and 5 not in window and window.stop == 5


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(seed=None), ValueError, "`seed` is required"),
        (dict(seed="7"), TypeError, "`seed` must be an int"),
        (dict(global_step=-1), ValueError, "`global_step` must be >= 0"),
        (dict(prompt_group=1.0), TypeError, "`prompt_group` must be an int"),
        (dict(window_size=9), ValueError, "does not fit sde_window_range"),
        (dict(window_range=(4, 20)), ValueError, "must satisfy 0 <= low < high <= num_steps"),
        (dict(window_range=(5, 5)), ValueError, "must satisfy"),
        # the key is hashed as signed 64-bit integers (was a bare struct.error)
        (dict(seed=2**63), ValueError, r"`seed` must be <= 2\*\*63 - 1"),
        (dict(seed=-(2**63) - 1), ValueError, "`seed` must be >= "),
        (dict(global_step=2**63), ValueError, r"`global_step` must be <= 2\*\*63 - 1"),
        (dict(prompt_group=2**64), ValueError, r"`prompt_group` must be <= 2\*\*63 - 1"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, message):
    arguments = dict(seed=1, global_step=0, prompt_group=0, **RUN) | kwargs
    with pytest.raises(error, match=message):
        draw_sde_window(**arguments)


def test_bad_schedules_and_windows():
    with pytest.raises(ValueError, match="Unknown SDE window kind 'sliding'"):
        SDEWindowSchedule("sliding", num_steps=10, window_size=2)
    with pytest.raises(ValueError, match="`every` must be >= 1"):
        SDEWindowSchedule("progressive", num_steps=10, window_size=2, every=0)
    with pytest.raises(ValueError, match="does not fit a schedule of 10 steps"):
        SDEWindow(start=9, size=2, num_steps=10)
    with pytest.raises(ValueError, match="`seed` is required"):
        SDEWindowSchedule("fixed", num_steps=10, window_size=2).window(seed=None, global_step=0, prompt_group=0)
