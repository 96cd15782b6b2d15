"""Demonstration: a checkpoint helper that forgets the RNG state slowly degrades training.

    .venv/bin/python scripts/demo_checkpoint_divergence.py                 # ~30-60 s on a CPU
    .venv/bin/python scripts/demo_checkpoint_divergence.py --steps 1500 --out /tmp/divergence.png

Trains the same small flow-matching denoiser with dropout (`ToyDenoiser`, residual blocks
checkpointed) twice from the same initial weights, the same batches and the same dropout RNG: once
with `rng_unsafe_checkpoint` (a reproduction of the home-made helper that re-runs the forward in
backward without restoring the RNG, so dropout draws a new mask) and once with
`rollout_consistency.training.checkpointing.checkpoint`. Nothing crashes; the broken run just learns worse, because
its gradients belong to a different network than its loss. The script writes both training-loss
curves and both held-out losses to a PNG, prints the final losses, and runs
`check_checkpointing` on each helper, which tells them apart in one step.

A demonstration, not a test: the figures depend on the CPU's float summation order only through
ordinary rounding, and the run is seeded end to end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from rollout_consistency.training.checkpoint_check import check_checkpointing
from rollout_consistency.training.checkpointing import checkpoint
from rollout_consistency.training.rng_state import isolated_rng
from rollout_consistency.training.toy_denoiser import ToyDenoiser, rng_unsafe_checkpoint, toy_flow_matching_batch

HELPERS = {
    "broken (RNG not restored)": rng_unsafe_checkpoint,
    "fixed (rollout_consistency.training.checkpointing)": checkpoint,
}


def train(checkpoint_fn, args: argparse.Namespace) -> dict[str, list[float]]:
    with isolated_rng(args.seed):
        model = ToyDenoiser(
            dim=8, width=args.width, depth=args.depth, dropout=args.dropout, checkpoint_fn=checkpoint_fn
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed + 1)
    x_eval, t_eval, v_eval = toy_flow_matching_batch(torch.Generator().manual_seed(args.seed + 2), 4096)
    history: dict[str, list[float]] = {
        "train": [],
        "eval_step": [],
        "eval": [],
        "grad_error_step": [],
        "grad_error": [],
    }
    with isolated_rng(args.seed + 3):  # dropout masks: same stream for both helpers
        for step in range(args.steps):
            x_t, t, v_target = toy_flow_matching_batch(data, args.batch)
            loss = nn.functional.mse_loss(model(x_t, t), v_target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history["train"].append(loss.item())
            if (step + 1) % args.eval_every == 0 or step == 0:
                model.eval()
                with torch.no_grad():
                    history["eval"].append(nn.functional.mse_loss(model(x_eval, t_eval), v_eval).item())
                model.train()
                history["eval_step"].append(step + 1)
                # How far this helper's gradient is from the true one, on the current weights.
                model.checkpoint_fn = None
                report = check_checkpointing(
                    model,
                    (x_t, t),
                    checkpoint_fn,
                    segments=["blocks.*"],
                    loss_fn=lambda v, target=v_target: nn.functional.mse_loss(v, target),
                    seed=step,
                    baseline=False,
                )
                model.checkpoint_fn = checkpoint_fn
                history["grad_error_step"].append(step + 1)
                history["grad_error"].append(report.global_relative_diff)
    return history


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot(histories: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = {name: colour for name, colour in zip(histories, ("tab:red", "tab:blue"), strict=False)}
    for name, history in histories.items():
        steps = range(1, len(history["train"]) + 1)
        axes[0].plot(steps, history["train"], color=colours[name], alpha=0.15, linewidth=0.8)
        axes[0].plot(steps, smooth(history["train"], 50), color=colours[name], label=name)
        axes[1].plot(history["eval_step"], history["eval"], "o-", color=colours[name], label=name, markersize=3)
        axes[2].plot(
            history["grad_error_step"], history["grad_error"], "o-", color=colours[name], label=name, markersize=3
        )
    axes[0].set(
        title=f"training loss (dropout {args.dropout}, 50-step mean)", xlabel="step", ylabel="flow-matching MSE"
    )
    axes[1].set(title="held-out loss (dropout off)", xlabel="step", ylabel="flow-matching MSE")
    axes[2].set(title="gradient error vs. no checkpointing", xlabel="step", ylabel="‖g − g_true‖ / ‖g_true‖")
    axes[2].set_ylim(bottom=0)
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle("Gradient checkpointing without RNG restore: same seed, same data, different training")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("out/checkpoint_divergence.png"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    histories = {name: train(fn, args) for name, fn in HELPERS.items()}
    plot(histories, args)

    print(f"{args.steps} steps, dropout {args.dropout}, seed {args.seed}, {time.perf_counter() - start:.0f} s")
    tail = min(50, args.steps)
    for name, history in histories.items():
        print(
            f"  {name:<36} final train loss (mean of last {tail}) {sum(history['train'][-tail:]) / tail:.4f}   "
            f"held-out {history['eval'][-1]:.4f}   gradient error {history['grad_error'][-1]:.3f}"
        )
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
