"""Run a function on N real gloo ranks: processes started once, reused by every test.

``Ranks(2).run(torch.distributed.get_rank)`` returns ``[0, 1]``. Each rank is a spawned process with a gloo process group over a TCP store that this process
hosts on a free port of 127.0.0.1. ``run(fn, *args)`` pickles ``fn`` (a module-level
function) and its arguments to every rank and returns the per-rank results. When a rank
raises, the others get a short grace period, then the pool is torn down and restarted, and
the error names the failing rank and shows its traceback. A run that outlasts its timeout
tears the pool down the same way. Nothing outlives ``close()``.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch.distributed as dist

__all__ = ["Ranks", "RankError", "mesh"]


@functools.cache
def mesh(*shape: int, names: tuple | None = None):
    """The CPU device mesh of ``shape`` over this rank's world, made once per rank and reused."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


class RankError(AssertionError):
    """A function raised (or hung) on a rank; the message carries that rank's traceback and
    ``results`` what the other ranks returned."""

    def __init__(self, message: str, results: dict):
        super().__init__(message)
        self.results = results


def _worker(rank: int, world_size: int, port: int, conn, log_path: str) -> None:
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    import torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    """A pool of ``world_size`` gloo ranks on 127.0.0.1 (see the module docstring)."""

    def __init__(self, world_size: int, *, timeout: float = 240.0, grace: float = 5.0):
        self.world_size, self.timeout, self.grace = world_size, timeout, grace
        self._procs: list = []
        self._conns: list = []
        self._logdir = tempfile.TemporaryDirectory(prefix=f"tpfn-ranks{world_size}-")

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            log = os.path.join(self._logdir.name, f"rank{rank}.log")
            p = ctx.Process(
                target=_worker, args=(rank, self.world_size, self._store.port, child, log),
                daemon=True, name=f"tpfn-rank{rank}",
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self._logdir.cleanup()

    def _log_tail(self, rank: int, lines: int = 30) -> str:
        try:
            with open(os.path.join(self._logdir.name, f"rank{rank}.log")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the list of results, rank by rank."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + (timeout or self.timeout)
        while pending:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, self.grace)
            ready = wait(list(pending.values()), timeout=max(0.0, left))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready:
                    del pending[rank]
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        status, value = "error", f"rank {rank} died:\n{self._log_tail(rank)}"
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
        if errors or pending:
            self.close()
            name = getattr(fn, "__qualname__", repr(fn))
            if errors:
                rank = min(errors)
                hung = f"; ranks {sorted(pending)} did not finish" if pending else ""
                raise RankError(f"{name} raised on rank {rank}{hung}:\n{errors[rank]}", results)
            raise RankError(
                f"{name} did not finish within {timeout or self.timeout:.0f}s on ranks "
                f"{sorted(pending)}; last output of rank {min(pending)}:\n"
                f"{self._log_tail(min(pending))}", results
            )
        return [results[r] for r in range(self.world_size)]

