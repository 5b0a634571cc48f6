"""Functions the launcher tests run on spawned ranks (must be importable)."""

import os
import time

import torch
import torch.distributed as dist


def rank_and_sum():
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), int(os.environ["WORLD_SIZE"]), value.item()


def rank_one_fails():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever: the launcher must kill it


def sleeps_forever():
    time.sleep(600)
