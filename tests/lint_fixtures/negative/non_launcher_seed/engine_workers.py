"""non-launcher-seed, false-positive class: a rank in a mini-batch shuffle seed (verl's workers). The
trainer's own data order, not something a rollout drew. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import os

import torch


class TrainingWorker:
    def update_actor(self, data, seed, epochs, mini_batch_size, sde_window_size):
        dataloader = make_iterator(
            data,
            mini_batch_size=mini_batch_size // self.engine.get_data_parallel_size(),
            epochs=epochs,
            seed=seed + self.engine.get_data_parallel_rank(),
        )
        sde_type = "sde" if sde_window_size else "ode"
        return [self.engine.train_batch(batch, sde_type=sde_type) for batch in dataloader]


def device_placement(noise_level):
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(local_rank)
    if local_rank == 0:
        print("main process on", device, "noise level", noise_level)
    return device
