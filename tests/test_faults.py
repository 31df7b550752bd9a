"""Nothing hangs: when a rank raises, dies, or never comes, the others stop within the bound
with a ``CollectiveError`` naming the collective, what it served and the rank that is missing
(``tpfn.bounded``); a rank that raises in tpfn stops the ones waiting for it at once. Each case
runs on real gloo ranks with a bound of a few seconds."""

import datetime
import os
import re
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
# the words of a wait that passed the bound: the host's own, or gloo's where its timeout fires first
TIMED_OUT = r"it did not complete within 3 s"  # (gloo's own words vary: 'Operation timed out!', 'Timed out waiting ...')


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
    assert re.search(  # (the host's wait or gloo's own, whichever sees the bound first)
        f"failed: {TIMED_OUT}; rank 0 had not reached it. Find why in the output of rank 0 \\(an error, a hang, another "
        r"program\); if only slower, give the ranks longer \(each waits at most 3 s: parallelize\(\.\.\., "
        r"timeout=\.\.\.\), else the process group's timeout, at most 10 minutes\)\.$", message), message


def test_a_rank_that_dies_stops_the_others_within_the_timeout(fresh2):
    with pytest.raises(RankError, match="rank 0 died") as info:
        fresh2.run(_fault, "dies")
    waited, message = info.value.results[1]
    assert waited < TIMEOUT + 5
    assert "the all-reduce that moves the output of '2' (Linear)" in message
    assert "; rank 0 had not reached it. Find why in the output of rank 0" in message, message


def _fault_in(where: str, how: str):
    """Rank 0 raises (or dies) just before the collective at ``where``; rank 1's error names it
    and rank 0. The bound is the group's timeout."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 10))
    tpfn.parallelize(model, mesh, {"0": tpfn.sequence_parallel(dim=0),
                                   "1": tpfn.prepare_in(tpfn.Shard(0), desired=tpfn.Replicate())
                                   >> colwise(local=False)})
    try:
        if where == "flush":  # the norm's gradient is in, not yet summed over the ranks
            model[0].weight.register_post_accumulate_grad_hook(lambda p: _fail_on_0("flush", how))
        logits = model(torch.randn(3, 4))  # this rank's 3 of the 6 positions
        if where == "loss":
            _fail_on_0("loss", how)
        loss = tpfn.cross_entropy(logits, torch.arange(6))
        loss.backward()
        if where == "clip":
            _fail_on_0("clipping", how)
        tpfn.clip_grad_norm_(model.parameters(), 1.0)
    except ValueError:
        return "raised"
    except tpfn.CollectiveError as error:
        return str(error)
    return "finished"


def _fail_on_0(where: str, how: str):
    if dist.get_rank() == 0:
        if how == "dies":
            os._exit(1)
        raise ValueError(f"rank 0 fails before the {where}")


@pytest.mark.parametrize("how", ["raises", "dies"])
@pytest.mark.parametrize("where, what", [
    ("loss", "cross_entropy's all-reduce of the per-token maxima failed"),
    ("flush", "the all-reduce of the partial gradients of 0.bias, 0.weight at the end of the "
              "backward failed"),
    ("clip", "clip_grad_norm_'s all-reduce of the gradients' norm over mesh dim 0 failed"),
])
def test_a_fault_before_any_collective_tpfn_issues_is_named_on_the_other_ranks(fresh2, where, what, how):
    """Not only the slots' moves: the loss, the end-of-backward gradient flush and clipping
    name the collective that failed and the rank that had not reached it, within the bound
    (a rank that dies: at once)."""
    if how == "dies":
        with pytest.raises(RankError, match="rank 0 died") as info:
            fresh2.run(_fault_in, where, how)
        message = info.value.results[1]
    else:
        raised, message = fresh2.run(_fault_in, where, how)
        assert raised == "raised", raised
    assert message.startswith(f"rank 1: {what}: "), message
    assert "; rank 0 had not reached it. Find why in the output of rank 0" in message, message


def _fault_in_save(how: str, path: str):
    """Rank 0 fails while saving a checkpoint: it writes its shards then raises (rank 1 names
    the barrier it waited at), dies in the middle of the write (rank 1 names torch.distributed.
    checkpoint's collectives), or saves alone (``"alone"``: rank 1 never calls save, and rank 0
    names the barrier and rank 1). The checkpoint's collectives run on the default group, bound
    by its timeout, made short here (these ranks are the test's own)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.distributed_c10d import _set_pg_timeout

    model = tpfn.parallelize(nn.Linear(4, 8), DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                             colwise())  # (under the pool's timeout: fresh ranks start seconds apart)
    _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT))
    if dist.get_rank() == 0 and how == "raises":
        write = torch.distributed.checkpoint.save

        def write_then_fail(*args, **kwargs):
            write(*args, **kwargs)
            raise ValueError("rank 0 fails after writing its shards")

        torch.distributed.checkpoint.save = write_then_fail
    if dist.get_rank() == 0 and how == "dies":
        FileSystemWriter.write_data = lambda *args, **kwargs: os._exit(1)
    if dist.get_rank() == 1 and how == "alone":
        return "went on"
    start = time.monotonic()
    try:
        tpfn.checkpoint.save(path, model)
    except ValueError:
        return "raised"
    except tpfn.CollectiveError as error:
        return time.monotonic() - start, str(error)
    return "finished"


@pytest.mark.parametrize("how, rank, what", [
    ("raises", 1, "the barrier after writing the shards of checkpoint {path!r}"),
    ("dies", 1, "torch.distributed.checkpoint's collectives writing checkpoint {path!r}"),
    ("alone", 0, "the barrier before writing checkpoint {path!r}"),
])
def test_a_rank_that_fails_mid_save_stops_the_others_at_the_checkpoint_barrier(how, rank, what, tmp_path):
    """The other ranks fail within the bound, naming the collective, the checkpoint and the rank
    missing; the previous checkpoint (none here) is untouched: the write went to PATH.partial."""
    path = str(tmp_path / "step-3")
    with Ranks(2, grace=2 * TIMEOUT + 5) as ranks:
        if how == "dies":
            with pytest.raises(RankError, match="rank 0 died") as info:
                ranks.run(_fault_in_save, how, path)
            results = [None, info.value.results[1]]
        else:
            results = ranks.run(_fault_in_save, how, path)
    assert results[1 - rank] == {"raises": "raised", "dies": None, "alone": "went on"}[how]
    waited, message = results[rank]
    assert waited < TIMEOUT + 3, waited
    assert message.startswith(f"rank {rank}: {what.format(path=path)} failed: "), message
    assert f"; rank {1 - rank} had not reached it." in message, message
    assert not os.path.exists(path)


# --- the bound: every rank ends within it, with the collective and the missing rank named ------

def _mesh() -> DeviceMesh:
    """A mesh over a group of the test's own (a timed-out gloo group is unusable after), with
    torch's default timeout: the bound is parallelize's ``timeout=``."""
    return DeviceMesh.from_group(dist.new_group(), "cpu")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


PLAN = {"0": colwise(), "2": rowwise()}


def _timed(fn):
    """``fn()``'s result, or (seconds waited, message) of the ``CollectiveError`` it raised."""
    start = time.monotonic()
    try:
        return fn()
    except tpfn.CollectiveError as error:
        return time.monotonic() - start, str(error)


def _never_calls_forward():
    model = tpfn.parallelize(_mlp(), _mesh(), PLAN, timeout=TIMEOUT)
    if dist.get_rank() == 0:
        return "went on"  # and never calls forward
    return _timed(lambda: model(torch.randn(2, 4)))


def test_a_rank_that_never_calls_forward_is_named_by_the_others_within_the_bound(fresh2):
    left, (waited, message) = fresh2.run(_never_calls_forward)
    assert left == "went on" and TIMEOUT <= waited < TIMEOUT + 3, waited
    assert message.startswith(
        "rank 1: the all-reduce that moves the output of '2' (Linear) (Partial() -> Replicate()) failed: "), message
    assert re.search(f"failed: {TIMED_OUT}; rank 0 had not reached it\\.", message), message


def _raises_before_parallelize():
    mesh = _mesh()
    if dist.get_rank() == 0:
        return "raised"  # its error caught, it stays alive (a notebook, a retry loop)
    return _timed(lambda: tpfn.parallelize(_mlp(), mesh, PLAN, timeout=TIMEOUT))


def test_a_rank_that_raises_before_parallelize_and_stays_alive_is_named(fresh2):
    raised, (waited, message) = fresh2.run(_raises_before_parallelize)
    assert raised == "raised" and waited < TIMEOUT + 3, waited
    assert message.startswith("rank 1: parallelize's transfer of parameter '0.bias' from rank 0 failed: "), message
    assert "; rank 0 had not reached it. Find why in the output of rank 0" in message, message


def _one_rank_raises_in_a_bound_module():
    """Rank 0 alone passes None (a rank-asymmetric check); rank 1 waits at the row-wise sum."""
    model = tpfn.parallelize(_mlp(), _mesh(), PLAN, timeout=20)
    start = time.monotonic()
    try:
        model(None if dist.get_rank() == 0 else torch.randn(2, 4))
    except TypeError:
        return "raised"
    except tpfn.CollectiveError as error:
        return time.monotonic() - start, str(error)


def test_an_error_one_rank_raises_in_tpfn_stops_the_others_promptly(fresh2):
    """Long before the bound (20 s): once the error has stood for PATIENCE (3 s)."""
    raised, (waited, message) = fresh2.run(_one_rank_raises_in_a_bound_module)
    assert raised == "raised" and waited < 8, waited
    assert message == (
        "rank 1: the all-reduce that moves the output of '2' (Linear) (Partial() -> Replicate()) stopped: rank 0 "
        "raised before reaching it (TypeError: input 0 of '0' (Linear) is None, but colwise() computes on it "
        "(Replicate()); pass it a tensor). Fix that error (rank 0's own traceback says where); every rank then "
        "runs alike.")


def _slow_after_a_caught_error():
    """Both ranks raise alike and go on (the error caught); then rank 0 is slower than a slice
    (and than PATIENCE) to reach the next collective: the wait goes on, one device's numbers."""
    model, ref = tpfn.parallelize(_mlp(), _mesh(), PLAN, timeout=60), _mlp()  # (slice 1 s, PATIENCE 3 s)
    with pytest.raises(TypeError):
        model(None)
    x = torch.randn(2, 4)
    if dist.get_rank() == 0:
        time.sleep(2)
    return (model(x) - ref(x)).abs().max().item()


def test_a_slow_rank_after_a_caught_error_is_waited_for(fresh2):
    assert max(fresh2.run(_slow_after_a_caught_error)) < 1e-6


class _TakenBackWhileRead:
    """The store as a reader sees it when the rank that told of an error takes it back between
    the reader's check of the key and its read of it."""

    def __init__(self, store):
        self.store = store

    def check(self, keys):
        from tpfn import bounded

        seen = self.store.check(keys)
        bounded._retract()
        return seen

    def get(self, key):
        return self.store.get(key)


def test_an_error_taken_back_while_another_rank_reads_it_never_makes_it_wait(monkeypatch):
    """A read of a key deleted since its check would wait for the store's timeout (and the
    collective meanwhile for its bound): a taken-back error is emptied, never deleted."""
    from tpfn import bounded

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setattr(bounded.Bound, "_issued", lambda self: 3)
    teller, reader = object.__new__(bounded.Bound), object.__new__(bounded.Bound)
    teller.store, teller.rank = store, 0
    reader.store, reader.rank, reader.group = _TakenBackWhileRead(store), 1, type("Group", (), {"size": lambda self: 2})()
    bounded.announce(TypeError("told"), teller)
    start = time.monotonic()
    assert reader._raised(4) is None and time.monotonic() - start < 1
    bounded.announce(TypeError("told again"), teller)
    reader.store = store
    assert reader._raised(4) == (0, "TypeError: told again")
    bounded._retract()


class _Work:
    """A collective that completes at ``done`` (monotonic seconds); each wait passes a slice."""

    def __init__(self, done):
        self.done = done

    def is_completed(self):
        return time.monotonic() >= self.done

    def wait(self, timeout):
        time.sleep(timeout.total_seconds())
        if not self.is_completed():
            raise RuntimeError("Operation timed out!")


def test_a_collective_done_while_the_store_was_read_is_not_called_stalled(monkeypatch):
    """A wait whose reading of the store outlasts the bound returns where the collective completed."""
    from tpfn import bounded

    bound = object.__new__(bounded.Bound)
    bound.seconds, bound.sliced, bound.slice, bound.rank = 0.4, True, datetime.timedelta(seconds=0.1), 0
    monkeypatch.setattr(bounded.Bound, "_issued", lambda self: 1)
    monkeypatch.setattr(bounded.Bound, "_post", lambda self, kind, value: None)
    monkeypatch.setattr(bounded.Bound, "_raised", lambda self, k: time.sleep(0.5))  # a slow store
    bound.wait(_Work(time.monotonic() + 0.3))  # completes during the read, the bound passed after it
    with pytest.raises(bounded.Stalled, match="^it did not complete within 0.4 s$"):
        monkeypatch.setattr(bounded.Bound, "_missing", lambda self, k: [1])
        bound.wait(_Work(time.monotonic() + 60))


class _DoneAsASliceEnds:
    """A collective that completes as this rank's ``n``-th slice gives up on it: that wait
    raises the slice's "timed out", and ``is_completed()`` then says done (``error``: it
    completed with that error, as where a peer's connection closed)."""

    def __init__(self, n, error=None):
        self.n, self.error, self.waits = n, error, 0

    def is_completed(self):
        return self.waits >= self.n

    def wait(self, timeout):
        self.waits += 1
        if self.waits <= self.n:
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_a_collective_done_as_a_slice_ends_is_not_called_failed(monkeypatch):
    """The slice's own "timed out" is no failure of the collective: its wait says how it ended."""
    from tpfn import bounded

    bound = object.__new__(bounded.Bound)
    bound.seconds, bound.sliced, bound.slice, bound.rank = 60.0, True, datetime.timedelta(seconds=0.01), 0
    for kind, value in (("_issued", lambda self: 1), ("_post", lambda self, kind, value: None),
                        ("_raised", lambda self, k: None), ("_missing", lambda self, k: [1])):
        monkeypatch.setattr(bounded.Bound, kind, value)
    for n in (1, 3):  # the first slice (no store read yet), a later one
        bound.wait(_DoneAsASliceEnds(n))
        with pytest.raises(bounded.Stalled, match="^Connection closed by peer$"):
            bound.wait(_DoneAsASliceEnds(n, "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer. "))


def _dies_before_parallelize():
    mesh = _mesh()
    if dist.get_rank() == 0:
        os._exit(1)
    return _timed(lambda: tpfn.parallelize(_mlp(), mesh, PLAN, timeout=20))


def test_a_rank_that_dies_before_parallelize_is_named_at_once(fresh2):
    """The dead rank's connections close: the others stop long before the bound (20 s)."""
    with pytest.raises(RankError, match="rank 0 died") as info:
        fresh2.run(_dies_before_parallelize)
    waited, message = info.value.results[1]
    assert waited < 5, waited
    assert message.startswith("rank 1: parallelize's transfer of parameter '0.bias' from rank 0 failed: "), message
    assert "; rank 0 had not reached it." in message, message


def test_the_bound_is_a_positive_number_of_seconds():
    from tpfn.dryrun import fake_mesh

    for bad in (0, -1.0, float("nan"), "10", True):
        with pytest.raises(ValueError, match=r"^'timeout' must be a positive number of seconds or a "
                                             r"datetime\.timedelta \(got .*\); e\.g\. timeout=60\.$"):
            tpfn.parallelize(_mlp(), fake_mesh(2), PLAN, src_rank=None, timeout=bad)
    model = tpfn.parallelize(_mlp(), fake_mesh(2), PLAN, src_rank=None, timeout=datetime.timedelta(minutes=1))
    assert tpfn.interpret.parallelize.runtime(model[0]).state.bound.seconds == 60.0
