"""The trainer's entry point, shaped like verl's `main_ppo.py` (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import argparse

from myproj.workers.fsdp_workers import ActorRolloutRefWorker


def run_ppo(config):
    worker = ActorRolloutRefWorker(config)
    for _ in range(config.total_steps):
        batch = worker.generate_sequences(config.prompts)
        worker.update_actor(batch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollout", default="sde")
    run_ppo(parser.parse_args())
