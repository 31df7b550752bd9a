"""Faults: when a rank raises or dies mid-forward, the others stop with a clear error, within
the process group's timeout, instead of hanging."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import tpfn
from tests.ranks import RankError, Ranks
from tpfn import colwise, rowwise

TIMEOUT = 3  # seconds: the bound the process group sets


@pytest.fixture(scope="module")
def fresh2():
    """Ranks of their own: a fault may leave a process group unusable."""
    with Ranks(2, grace=2 * TIMEOUT + 5) as ranks:
        yield ranks


class Faulty(nn.Module):
    """Fails on rank 0 between the column-wise and the row-wise layer."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if dist.get_rank() == 0:
            if self.how == "dies":
                os._exit(1)
            raise ValueError("a bad batch on rank 0")
        return torch.relu(x)


def _fault(how):
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = nn.Sequential(nn.Linear(4, 8), Faulty(how), nn.Linear(8, 4))
    tpfn.parallelize(model, mesh, {"0": colwise(), "2": rowwise()})
    start = time.monotonic()
    try:
        model(torch.randn(2, 4))
    except ValueError:
        return "raised"
    except tpfn.CollectiveError as error:
        return time.monotonic() - start, str(error)
    return "finished"


def test_a_rank_that_raises_stops_the_others_within_the_timeout(fresh2):
    raised, (waited, message) = fresh2.run(_fault, "raises")
    assert raised == "raised" and waited < TIMEOUT + 5
    assert message.startswith(
        "rank 1: the all-reduce that moves the output of '2' (Linear) (Partial() -> Replicate()) "
        "failed:")
    assert message.endswith(
        "Another rank has most likely failed (its own error says why) or runs another plan; the "
        "wait is bounded by the process group's timeout (init_process_group(timeout=...)).")


def test_a_rank_that_dies_stops_the_others_within_the_timeout(fresh2):
    with pytest.raises(RankError, match="rank 0 died") as info:
        fresh2.run(_fault, "dies")
    waited, message = info.value.results[1]
    assert waited < TIMEOUT + 5
    assert "the all-reduce that moves the output of '2' (Linear)" in message
