"""A helper the trainer imports. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch.distributed as dist

from .parallel_states import nccl_info


def main_print(content):
    if (not dist.is_initialized() or dist.get_rank() == 0) and nccl_info.rank_within_group == 0:
        print(content)
