"""Run a function on every rank: as is under torchrun, else on N local processes.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) each process initializes the process
group and runs the function. Run as a plain script, it starts the processes itself on
127.0.0.1 (gloo on CPU, NCCL when each process has a GPU).

The process group's timeout bounds how long a rank waits for a peer that never arrives
(PyTorch's default is 10 minutes for NCCL and 30 for gloo): ``TPFN_TIMEOUT`` seconds, 300
unless set. A rank that waits that long fails with a ``tpfn.CollectiveError`` naming the
module and the collective.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _init() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=float(os.environ.get("TPFN_TIMEOUT", 300)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)


def _worker(rank: int, world_size: int, port: int, main, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _init()
    try:
        main(*args)
    finally:
        dist.destroy_process_group()
    # Done and shut down: leave now. The interpreter's own teardown can abort a spawned rank that
    # accelerate's or FSDP's libraries left threads in ("terminate called without an active
    # exception", now and then, after every result was checked), which would fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(main, nprocs: int, *args) -> None:
    """``main(*args)`` on every rank of a ``nprocs``-process job."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _init()
        try:
            main(*args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_worker, args=(nprocs, port, main, args), nprocs=nprocs, start_method="spawn")
    except mp.ProcessExitedException as e:  # a rank's SystemExit: its message is printed already
        raise SystemExit(e.exit_code) from None
