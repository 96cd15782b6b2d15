"""A hydra-launched Flow-GRPO trainer: the sampler is `hydra.utils.instantiate(cfg.sampler)`, its class named
by `_target_` in configs/sampler/sde.yaml, so no file imports its module (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import hydra

from flowrl.trainer import grpo_step


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg):
    sampler = hydra.utils.instantiate(cfg.sampler)
    for epoch in range(cfg.num_epochs):
        samples = sampler.sample(cfg.prompts)
        grpo_step(cfg, sampler, samples)


if __name__ == "__main__":
    main()
