"""Doctests in tpfn/ see tpfn's public names, torch and nn, and run on a one-rank gloo group."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tpfn


@pytest.fixture(autouse=True)
def _doctest_setup(request):
    if isinstance(request.node, pytest.DoctestItem):
        request.getfixturevalue("doctest_namespace").update(
            {name: getattr(tpfn, name) for name in tpfn.__all__}, tpfn=tpfn, torch=torch, nn=nn)
        if not dist.is_initialized():
            store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True,
                                  timeout=datetime.timedelta(seconds=30))
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
