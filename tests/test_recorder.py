"""Step1Recorder inside a flow_grpo-shaped training loop: shuffled samples, per-sample timestep permutations,
per-timestep micro-batches, gradient accumulation; stops at the first optimizer step; 2 ranks on gloo."""

from __future__ import annotations

import math
import os
import socket

import numpy as np
import pytest
import torch

from rollout_consistency.gate.tables.dump import read_dump
from rollout_consistency.gate.tables.recorder import RecorderError, Step1GateFailed, Step1Recorder

N, T, D = 8, 4, 16
TIMESTEPS = torch.linspace(1.0, 0.25, T)


class Policy(torch.nn.Module):
    """Elementwise only: a row's log-prob does not depend on its batch-mates, so both sides agree bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(D, generator=generator))
        self.shift = torch.nn.Parameter(0.1 * torch.randn(D, generator=generator))

    def log_prob(self, x: torch.Tensor, t: torch.Tensor, x_next: torch.Tensor, *, bf16: bool = False) -> torch.Tensor:
        h = x.bfloat16().float() if bf16 else x
        mean = torch.tanh(h * self.scale + self.shift * t[:, None])
        std = 0.5
        return (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=1)


def rollout(policy: Policy, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Samples as flow_grpo stores them: latents (B, T+1, D), log_probs (B, T), timesteps (B, T)."""
    generator = torch.Generator().manual_seed(1)
    latents = [torch.randn(N, D, generator=generator)]
    log_probs = []
    with torch.no_grad():
        for j in range(T):
            t = TIMESTEPS[j].expand(N)
            x_next = torch.tanh(latents[-1] * policy.scale + policy.shift * t[:, None])
            x_next = x_next + 0.5 * torch.randn(N, D, generator=generator)
            log_probs.append(policy.log_prob(latents[-1], t, x_next))
            latents.append(x_next)
    samples = {
        "latents": torch.stack(latents, 1),
        "log_probs": torch.stack(log_probs, 1),
        "timesteps": TIMESTEPS.expand(N, T),
    }
    return {k: v[ids] for k, v in samples.items()} | {"ids": ids}


def train(policy, samples, optimizer, recorder, *, seed=0, micro=2, accumulate=2, bug=None, epochs=2):
    """flow_grpo's inner loop: permute samples, permute each sample's timesteps, micro-batch per timestep."""
    generator = torch.Generator().manual_seed(seed)
    n = samples["ids"].shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        perms = torch.stack([torch.randperm(T, generator=generator) for _ in range(n)])
        for k, start in enumerate(range(0, n, micro)):
            rows = order[start : start + micro]
            for j in range(T):
                steps = perms[rows, j]
                x = samples["latents"][rows, perms[rows, j]]
                x_next = samples["latents"][rows, perms[rows, j] + 1]
                t = samples["timesteps"][rows, perms[rows, j]]
                # The "unpermuted-timestep" bug permutes the latents but not the timesteps (a real slip).
                t_model = samples["timesteps"][rows, j] if bug == "unpermuted-timestep" else t
                log_prob = policy.log_prob(x, t_model, x_next, bf16=bug == "bf16")
                old = samples["log_probs"][rows, perms[rows, j]]
                recorder.record(samples["ids"][rows], steps, old, log_prob, timesteps=t)
                (-(torch.exp(log_prob - old)).mean()).backward()
            if (k + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()


def run_loop(tmp_path=None, **kwargs):
    policy = Policy()
    samples = rollout(policy, torch.arange(N))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    dump = None if tmp_path is None else tmp_path / "step1.safetensors"
    recorder = Step1Recorder(optimizer, dump=dump, num_steps=T, **kwargs.pop("recorder", {}))
    train(policy, samples, optimizer, recorder, **kwargs)
    return recorder


def test_flow_grpo_loop_records_until_the_first_step_and_passes(tmp_path):
    recorder = run_loop(tmp_path)
    assert recorder.done and recorder.report.passed, recorder.report.format_table()
    # micro 2 x accumulate 2: the first step comes after 4 samples x every timestep, in shuffled order.
    assert recorder.report.metrics.num_samples == 4 and recorder.report.metrics.num_positions == T
    assert recorder.report.metrics.overall.max_abs_dlogp == 0.0
    dump = read_dump(tmp_path / "step1.safetensors")
    assert list(dump.sample_ids) == sorted(dump.sample_ids) and np.array_equal(dump.timesteps[0], TIMESTEPS.numpy())
    assert dump.gate().passed


def test_a_trainer_bug_fails_the_gate():
    bf16 = run_loop(bug="bf16").report
    assert not bf16.passed and any(r.startswith("max_abs_dlogp") for r in bf16.reasons)
    unpermuted = run_loop(bug="unpermuted-timestep").report
    assert not unpermuted.passed and unpermuted.metrics.overall.max_abs_dlogp > 1e-3
    with pytest.raises(Step1GateFailed, match="max_abs_dlogp"):
        run_loop(bug="bf16", recorder={"raise_on_fail": True})


def test_fails_closed_on_bad_recordings():
    recorder = Step1Recorder(num_steps=2)
    one = torch.tensor([-1.0, -2.0])
    recorder.record(torch.tensor([0, 1]), 0, one, one.clone())
    with pytest.raises(RecorderError, match="sample 1 step 0 recorded twice"):
        recorder.record(torch.tensor([1]), 0, one[:1], one[:1].clone())
    with pytest.raises(RecorderError, match="shape"):
        recorder.record(torch.tensor([2, 3]), 0, one, one[:1])
    with pytest.raises(RecorderError, match="nan at sample 5 step 1"):
        recorder.record(torch.tensor([5]), 1, one[:1], torch.tensor([float("nan")]))
    with pytest.raises(RecorderError, match="bfloat16"):
        recorder.record(torch.tensor([6]), 1, one[:1], one[:1].bfloat16())
    with pytest.raises(RecorderError, match=r"missing .*sample 0 step 1"):
        recorder.finish()
    with pytest.raises(RecorderError, match="nothing was recorded"):
        Step1Recorder().finish()
    absent = Step1Recorder(expected_samples=3)
    absent.record(torch.tensor([0, 1]), 0, one, one.clone())
    report = absent.finish()  # a sample never recorded is a `complete` FAIL in the report, naming it
    assert not report.passed and report.run["coverage"]["not_gated"] == [2]
    (reason,) = [r for r in report.reasons if r.startswith("complete:")]
    assert "1 of the 3 samples the rollout produced were not gated (ids [2])" in reason


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, directory: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for name, bug_rank in (("clean", -1), ("bf16-on-rank-1", 1)):
            policy = Policy()
            ids = torch.arange(rank * (N // world), (rank + 1) * (N // world))  # global ids of this rank's shard
            samples = rollout(policy, ids)
            optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
            recorder = Step1Recorder(optimizer, dump=os.path.join(directory, f"{name}.safetensors"), num_steps=T)
            bug = "bf16" if rank == bug_rank else None
            train(policy, samples, optimizer, recorder, seed=rank, bug=bug, accumulate=1)
            # Every rank holds the gathered tables and the same verdict.
            assert recorder.report.metrics.num_samples == 2 * world, recorder.report.metrics.num_samples
            assert recorder.report.passed == (bug_rank < 0), recorder.report.reasons
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_gloo_gather_one_dump(tmp_path):
    torch.multiprocessing.spawn(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for name, passes in (("clean", True), ("bf16-on-rank-1", False)):
        dump = read_dump(tmp_path / f"{name}.safetensors")
        # micro 2, no accumulation: the first step comes after one micro-batch (2 samples) on each rank.
        assert len(dump.sample_ids) == 4 and {int(i) // (N // 2) for i in dump.sample_ids} == {0, 1}
        report = dump.gate()
        assert report.passed == passes
        if not passes:  # only rank 1's samples differ
            bad = {report.sample_ids[s.index] for s in report.metrics.by_sample if s.values.max_abs_dlogp > 0}
            assert bad and all(i >= N // 2 for i in bad)


# ------------------------------------------------------------------------------------------------
# the optimizers real trainers hold, and what the recording covers (issue 24)


def _accelerate_loop(accumulation: int, *, expected: int | None, scheduler_to_recorder: bool = False):
    """flow_grpo's loop under accelerate: `optimizer.step()` after every micro-batch inside
    `accelerator.accumulate`, an lr scheduler stepped with it; real accelerate on the CPU."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import GradientAccumulationPlugin

    accelerator = accelerate.Accelerator(
        cpu=True,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False),
    )
    policy = Policy()
    samples = rollout(policy, torch.arange(N))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    held = scheduler if scheduler_to_recorder else optimizer
    recorder = Step1Recorder(held, num_steps=T, expected_samples=expected)
    before = [p.detach().clone() for p in policy.parameters()]
    changed_at = None
    for k, rows in enumerate(torch.arange(N).split(2)):
        with accelerator.accumulate(policy):
            for j in range(T):
                t = samples["timesteps"][rows, j]
                log_prob = policy.log_prob(samples["latents"][rows, j], t, samples["latents"][rows, j + 1])
                recorder.record(rows, j, samples["log_probs"][rows, j], log_prob, timesteps=t)
                accelerator.backward(-(torch.exp(log_prob - samples["log_probs"][rows, j])).mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        moved = any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
        if moved and changed_at is None:
            changed_at = k
    return recorder, changed_at


def test_accelerate_accumulation_records_until_the_first_real_update():
    recorder, changed_at = _accelerate_loop(2, expected=4)
    # AcceleratedOptimizer.step() runs after every micro-batch but updates only when the gradients sync: the first
    # real update comes after micro-batch 1, so both micro-batches (4 samples) are step 1.
    assert changed_at == 1
    report = recorder.report
    assert report.passed, report.reasons
    assert report.metrics.num_samples == 4 and report.run["coverage"]["not_gated"] == []
    assert "AdamW (inside AcceleratedOptimizer)" in report.run["coverage"]["ended_by"]


def test_a_scheduler_handed_to_the_recorder_finds_its_optimizer():
    recorder, _ = _accelerate_loop(1, expected=None, scheduler_to_recorder=True)
    assert recorder.done and recorder.report.metrics.num_samples == 2
    assert "inside LambdaLR inside AcceleratedScheduler" in recorder.report.run["coverage"]["ended_by"]


def test_updates_after_each_micro_batch_gate_only_the_first_and_say_so(tmp_path):
    # The loop: the optimizer updates after each micro-batch. Without expected_samples the report says how
    # many samples were recorded and `complete` is not checked; with it, `complete` FAILs naming those not gated.
    unknown, _ = _accelerate_loop(1, expected=None)
    assert unknown.report.passed and "complete" in unknown.report.not_checked
    assert any("recorded 2 samples x 4 steps" in note for note in unknown.report.notes)
    known, _ = _accelerate_loop(1, expected=4)
    assert not known.report.passed
    (reason,) = [r for r in known.report.reasons if r.startswith("complete:")]
    assert "2 of the 4 samples the rollout produced were not gated (ids [2, 3])" in reason
    assert "not scored before the first optimizer update" in reason


class DeepSpeedShapedEngine:
    """Stands in for what DeepSpeed hands a loop (not installed here): an engine whose documented `.optimizer` is a
    ZeRO wrapper (not a torch optimizer) whose `.optimizer` is the torch optimizer that updates. Only the attribute
    path is exercised; DeepSpeed itself is not run."""

    class ZeroOptimizer:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def step(self) -> None:
            self.optimizer.step()

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = self.ZeroOptimizer(optimizer)

    def step(self) -> None:
        self.optimizer.step()


def test_a_deepspeed_shaped_wrapper_is_looked_through():
    policy = Policy()
    engine = DeepSpeedShapedEngine(torch.optim.SGD(policy.parameters(), lr=0.1))
    recorder = Step1Recorder(engine, num_steps=1)
    one = torch.tensor([-1.0])
    recorder.record(torch.tensor([0]), 0, one, one.clone())
    engine.step()
    assert (
        recorder.done
        and "SGD (inside ZeroOptimizer inside DeepSpeedShapedEngine)" in recorder.report.run["coverage"]["ended_by"]
    )
    with pytest.raises(RecorderError, match="no torch optimizer found inside object"):
        Step1Recorder(object())


def test_nan_timesteps_and_negative_window_starts_are_refused_when_recorded(tmp_path):
    recorder = Step1Recorder(num_steps=1, dump=tmp_path / "d.safetensors")
    one = torch.tensor([-1.0, -2.0])
    with pytest.raises(RecorderError, match="timesteps is nan at sample 1 step 0"):
        recorder.record(torch.tensor([0, 1]), 0, one, one.clone(), timesteps=torch.tensor([1.0, float("nan")]))
    with pytest.raises(RecorderError, match="window_starts must be >= 0"):
        recorder.record(torch.tensor([0, 1]), 0, one, one.clone(), window_starts=torch.tensor([0, -1]))
    recorder.record(torch.tensor([0, 1]), 0, one, one.clone(), timesteps=torch.tensor([1.0, 1.0]))
    recorder.finish()
    # What the recorder writes, `gate` accepts, and reaches the same verdict with the same coverage.
    again = read_dump(tmp_path / "d.safetensors").gate()
    assert again.passed == recorder.report.passed and "complete" in again.not_checked


def test_digest_ids_identify_rows_without_ids_and_refuse_shared_initial_noise():
    """A loop with no sample ids (flow_grpo keeps none through its shuffle) can key rows by a digest of each sample's
    whole stored trajectory; the first step alone is not enough when a prompt group shares its initial noise."""
    from rollout_consistency.gate import digest_ids

    policy = Policy()
    samples = rollout(policy, torch.arange(N))
    samples["latents"][1, 0] = samples["latents"][0, 0]  # DanceGRPO's --init_same_noise: one group, one noise
    with torch.no_grad():  # ... as the rollout would have stored it
        x, x_next = samples["latents"][1:2, 0], samples["latents"][1:2, 1]
        samples["log_probs"][1, 0] = policy.log_prob(x, samples["timesteps"][1:2, 0], x_next)[0]
    recorder = Step1Recorder(num_steps=T, expected_samples=digest_ids(samples["latents"]).tolist())
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    for rows in order.split(2):
        ids = digest_ids(samples["latents"][rows])  # once per micro-batch, after the shuffle
        for j in range(T):
            t = samples["timesteps"][rows, j]
            new = policy.log_prob(samples["latents"][rows, j], t, samples["latents"][rows, j + 1])
            recorder.record(ids, j, samples["log_probs"][rows, j], new, timesteps=t)
    report = recorder.finish()
    assert report.passed and report.metrics.num_samples == N, report.reasons
    first_step = digest_ids(samples["latents"][:, 0])
    assert first_step[0] == first_step[1]  # the first step alone would give samples 0 and 1 one id


@pytest.mark.parametrize("step", [2, 3])
def test_a_step_at_or_beyond_num_steps_is_refused_by_name(step):
    # Steps are 0 .. num_steps-1: step == num_steps is the first one beyond (it was a bare KeyError when let through).
    recorder = Step1Recorder(num_steps=2)
    one = torch.tensor([-1.0])
    for recorded in (0, 1, step):
        recorder.record(torch.tensor([0]), recorded, one, one.clone())
    with pytest.raises(RecorderError, match=f"sample 0 step {step} is beyond num_steps=2"):
        recorder.finish()


def test_one_call_holding_a_cell_twice_or_two_values_for_one_sample_is_refused():
    # Within a single record() call too: the same (sample, step) twice, or one sample with two prompt groups.
    two = torch.tensor([-1.0, -1.0])
    with pytest.raises(RecorderError, match="sample 0 step 0 recorded twice"):
        Step1Recorder().record(torch.tensor([0, 0]), 0, two, two.clone())
    with pytest.raises(RecorderError, match="sample 0: prompt_groups was 1 and is now 2"):
        Step1Recorder().record(
            torch.tensor([0, 0]), torch.tensor([0, 1]), two, two.clone(), prompt_groups=torch.tensor([1, 2])
        )
