"""The multi-rank helpers catch what they promise: wrong ranks, raised errors, hangs."""

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankError, run_processes, run_threads

RUNNERS = [
    pytest.param(run_processes, marks=pytest.mark.multiprocess, id="processes"),
    pytest.param(run_threads, id="threads"),
]


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, dist.get_world_size(), t.item()


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the other ranks wait for rank 1 in a collective and must be released
    return rank


def _hang(rank, world_size, seconds):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 is elsewhere: rank 0 waits in the collective
    else:
        time.sleep(seconds)
    return rank


@pytest.mark.parametrize("run", RUNNERS)
def test_collectives_see_every_rank(run):
    results = run(_sum_of_ranks, 3)
    assert results == [(r, 3, 6.0) for r in range(3)]  # 1 + 2 + 3


@pytest.mark.parametrize("run", RUNNERS)
def test_a_rank_that_raises_fails_with_its_traceback(run):
    with pytest.raises(RankError) as caught:
        run(_raise_on_rank_1, 2, timeout=60)
    message = str(caught.value)
    assert "rank 1" in message and "ValueError: boom on purpose" in message
    assert "_raise_on_rank_1" in message  # the traceback, not only the message
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("run", RUNNERS)
def test_hung_ranks_fail_with_their_stacks(run):
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run(_hang, 2, 8.0, timeout=4)
    message = str(caught.value)
    assert "did not finish within 4 s" in message
    rank0, rank1 = message.split("--- rank 1 ---")
    assert "--- rank 0 ---" in rank0 and "_hang" in rank0 and "all_reduce" in rank0  # where rank 0 waits
    assert "in _hang" in rank1
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()
