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


def _fault_in(where: str):
    """Rank 0 raises just before the collective at ``where``; rank 1's error names it."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 10))
    tpfn.parallelize(model, mesh, {"0": tpfn.sequence_parallel(dim=0),
                                   "1": tpfn.prepare_in(tpfn.Shard(0), desired=tpfn.Replicate())
                                   >> colwise(local=False)})
    try:
        if where == "flush":  # the norm's gradient is in, not yet summed over the ranks
            model[0].weight.register_post_accumulate_grad_hook(lambda p: _raise_on_0("flush"))
        logits = model(torch.randn(3, 4))  # this rank's 3 of the 6 positions
        if where == "loss" and dist.get_rank() == 0:
            raise ValueError("rank 0 fails before the loss")
        loss = tpfn.cross_entropy(logits, torch.arange(6))
        loss.backward()
        if where == "clip" and dist.get_rank() == 0:
            raise ValueError("rank 0 fails before clipping")
        tpfn.clip_grad_norm_(model.parameters(), 1.0)
    except ValueError:
        return "raised"
    except tpfn.CollectiveError as error:
        return str(error)
    return "finished"


def _raise_on_0(where):
    if dist.get_rank() == 0:
        raise ValueError(f"rank 0 fails before the {where}")


@pytest.mark.parametrize("where, what", [
    ("loss", "cross_entropy's all-reduce of the per-token maxima failed"),
    ("flush", "the all-reduce of the partial gradients of 0.bias, 0.weight at the end of the "
              "backward failed"),
    ("clip", "clip_grad_norm_'s all-reduce of the gradients' norm over mesh dim 0 failed"),
])
def test_a_fault_before_any_collective_tpfn_issues_is_named_on_the_other_ranks(where, what):
    """Not only the slots' moves: the loss, the end-of-backward gradient flush and clipping
    name the collective that failed, within the process group's timeout. (Ranks of their
    own each time: a timed-out gloo group can leave the pair of ranks out of step.)"""
    with Ranks(2, grace=2 * TIMEOUT + 5) as ranks:
        raised, message = ranks.run(_fault_in, where)
    assert raised == "raised", raised
    assert message.startswith(f"rank 1: {what}: "), message


def _fault_in_save(how: str, path: str):
    """Rank 0 writes its shards of a checkpoint, then raises or dies; rank 1 names the barrier
    it waited at. The checkpoint's barriers run on the default group: its timeout is made
    short here (these ranks are the test's own)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT))
    model = tpfn.parallelize(nn.Linear(4, 8), DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                             colwise())
    if dist.get_rank() == 0:
        write = torch.distributed.checkpoint.save

        def write_then_fail(*args, **kwargs):
            write(*args, **kwargs)
            if how == "dies":
                os._exit(1)
            raise ValueError("rank 0 fails after writing its shards")

        torch.distributed.checkpoint.save = write_then_fail
    start = time.monotonic()
    try:
        tpfn.checkpoint.save(path, model)
    except ValueError:
        return "raised"
    except tpfn.CollectiveError as error:
        return time.monotonic() - start, str(error)
    return "finished"


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_rank_that_fails_mid_save_stops_the_others_at_the_checkpoint_barrier(how, tmp_path):
    """The other ranks fail within the timeout, naming the barrier and the checkpoint; the
    previous checkpoint (none here) is untouched: the write went to PATH.partial."""
    path = str(tmp_path / "step-3")
    with Ranks(2, grace=2 * TIMEOUT + 5) as ranks:
        if how == "raises":
            results = ranks.run(_fault_in_save, how, path)
        else:
            with pytest.raises(RankError, match="rank 0 died") as info:
                ranks.run(_fault_in_save, how, path)
            results = [None, info.value.results[1]]
    if how == "raises":
        assert results[0] == "raised"
    waited, message = results[1]
    assert waited < TIMEOUT + 5
    assert message.startswith(
        f"rank 1: the barrier after writing the shards of checkpoint {path!r} failed: "), message
    assert not os.path.exists(path)
