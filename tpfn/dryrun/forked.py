"""Run a function on N real ranks in one call: forked children over a private gloo group.

``on_ranks(run, fail, n, timeout=...)`` forks ``n`` children, then hosts a TCP store on a free
port of 127.0.0.1 and hands each child its port; each child makes a private gloo group and a
1-D mesh over it, and takes a second one as its default group (the parent's, copied by the
fork, set aside unused: ``dist.get_rank()`` is the child's rank, as under torchrun), calls
``run(rank, mesh)`` and sends back its value, or ``fail(rank, exception)`` for a failure, then
ends with ``os._exit``. Children are forked, not spawned: what ``run`` uses may live in
``__main__``, a notebook or a docs page, which a spawned process could not import. They are
all forked before the store exists: a fork copies the locks that other threads hold at that
instant, and the store's server thread, busy accepting the first children's connections,
would leave a later child a lock that no thread of it ever releases. The parent waits a
bounded time (``grace`` once a rank failed), then kills and reaps every child, whatever
happens.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import sys
import time
import uuid
from multiprocessing.connection import Pipe, wait

import torch
import torch.distributed as dist

from tpfn._torch import cpu_group, forget_default_group, private_mesh

__all__ = ["on_ranks"]


def _mesh(store, rank: int, n: int, timeout: float):
    """A 1-D mesh over a private gloo group of the ``n`` children (never the default group)."""
    gloo = dist.ProcessGroupGloo(store, rank, n, datetime.timedelta(seconds=timeout))
    group = cpu_group(store, rank, n, gloo)
    return private_mesh(f"tpfn-ranks-{n}-{uuid.uuid4().hex[:8]}", group, n, rank)


def _default_group(store, rank: int, n: int, timeout: float) -> None:
    """The children's own gloo group as this child's default group, so that a model asking
    ``torch.distributed.get_rank()`` (or reducing on the default group) sees this rank, as
    under torchrun; the caller's default group, copied by the fork, is set aside unused."""
    if dist.is_initialized():
        forget_default_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("tpfn-world/", store), rank=rank,
                            world_size=n, timeout=datetime.timedelta(seconds=timeout))


def _child(rank: int, n: int, conn, run, fail, timeout: float) -> None:
    """A forked child: the store's port received, one rank's run, its result (or its failure)
    sent back, then exit."""
    try:
        torch.set_num_threads(1)
        port = conn.recv()
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        _default_group(store, rank, n, timeout)
        result = ("ok", run(rank, _mesh(store, rank, n, timeout)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        result = ("error", fail(rank, exc))
    try:
        conn.send_bytes(pickle.dumps(result))
    finally:
        os._exit(0)


def on_ranks(run, fail, n: int, *, timeout: float, grace: float = 5.0) -> dict:
    """``{rank: ("ok", run's value) | ("error", fail's value)}``; a rank that dies or does not
    finish in ``timeout`` seconds is an error ``(message, "")``. Every child is killed and
    reaped before this returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids, conns = [], {}
    try:
        for rank in range(n):
            mine, theirs = Pipe()
            pid = os.fork()
            if pid == 0:  # the child
                mine.close()
                _child(rank, n, theirs, run, fail, timeout)
            theirs.close()
            pids.append(pid)
            conns[rank] = mine
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        for conn in conns.values():
            conn.send(store.port)
        results: dict = {}
        deadline = time.monotonic() + timeout
        while conns:
            failed = any(s == "error" for s, _ in results.values())
            left = min(deadline - time.monotonic(), grace if failed else timeout)
            ready = wait(list(conns.values()), timeout=max(0.0, left))
            if not ready:
                break
            for rank, conn in list(conns.items()):
                if conn in ready:
                    del conns[rank]
                    try:
                        results[rank] = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        results[rank] = ("error", (f"rank {rank} died without a word", ""))
                    conn.close()
        if conns:
            late = ", ".join(map(str, conns))
            results[min(conns)] = ("error", (
                f"rank{'s' if len(conns) > 1 else ''} {late} did not finish within {timeout:g}s "
                "(a collective that some rank never joined?); they were stopped", ""))
        return results
    finally:
        for conn in conns.values():
            conn.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
