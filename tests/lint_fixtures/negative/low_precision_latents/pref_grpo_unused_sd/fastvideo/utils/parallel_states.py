"""Sequence-parallel state, as FastVideo keeps it. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch.distributed as dist


class COMM_INFO:
    def __init__(self):
        self.sp_size = 1
        self.rank_within_group = 0


nccl_info = COMM_INFO()


def initialize_sequence_parallel_state(sequence_parallel_size):
    nccl_info.sp_size = sequence_parallel_size
    nccl_info.rank_within_group = dist.get_rank() % sequence_parallel_size if dist.is_initialized() else 0
