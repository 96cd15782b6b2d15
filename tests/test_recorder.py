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
    recorder.record(torch.tensor([0, 1]), 0, one, one)
    with pytest.raises(RecorderError, match="sample 1 step 0 recorded twice"):
        recorder.record(torch.tensor([1]), 0, one[:1], one[:1])
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
    with pytest.raises(RecorderError, match="never recorded"):
        absent = Step1Recorder(expected_samples=3)
        absent.record(torch.tensor([0, 1]), 0, one, one)
        absent.finish()


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
