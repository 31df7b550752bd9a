"""The three functions are pure: they build new values and leave their arguments alone."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard

from tests.ranks import mesh
from tpfn import (
    LayoutError, Replicate, Shard, colwise, prepare_in, prepare_inputs, prepare_out, prepare_outputs,
    shard_params,
)
from tpfn.style.stages import Inputs, Outputs
from tpfn.style.slot import Slot


def _pure():
    m = mesh(2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    new = shard_params(lin, m, {"weight": Shard(0), "bias": Replicate()})
    assert set(new) == {"weight", "bias"} and isinstance(new["weight"], nn.Parameter)
    assert new["weight"].placements == (TShard(0),) and new["bias"].placements == (TReplicate(),)
    assert torch.equal(new["weight"].to_local(), before["weight"].chunk(2)[rank])
    assert not isinstance(lin.weight, DTensor)
    assert all(torch.equal(v, before[k]) for k, v in lin.state_dict().items())
    try:  # packed parts that do not split evenly over the ranks
        shard_params(lin, m, {"weight": Shard(0, parts=2)})
        raise AssertionError("no error")
    except LayoutError as error:
        assert "each part (3) must split evenly over 2 ranks" in str(error)

    x = torch.arange(8.0).reshape(2, 4)
    args, kwargs = [x, "keep"], {"y": x}
    spec = Inputs(slots=(Slot(Shard(0), Replicate()),), kwargs=(("y", Slot(Replicate())),),
                     local=True)
    new_args, new_kwargs = prepare_inputs(tuple(args), kwargs, spec, m)
    assert args == [x, "keep"] and kwargs == {"y": x}
    assert new_args[1] == "keep" and new_args[0].shape == (4, 4)
    # a replicated local tensor that stays replicated moves nothing: the same tensor, in a new dict
    assert isinstance(new_kwargs["y"], torch.Tensor) and new_kwargs is not kwargs

    outputs = [x, x]
    out = prepare_outputs(outputs, Outputs(slots=(Slot(Replicate(), Shard(1)),), local=False), m)
    assert outputs == [x, x] and out is not outputs
    assert isinstance(out[0], DTensor) and out[0].placements == (TShard(1),) and out[1] is x
    return True


def test_shard_params_prepare_inputs_and_prepare_outputs_are_pure(ranks2):
    assert all(ranks2.run(_pure))


def _styles_as_specs():
    m = mesh(2)
    rank = dist.get_rank()
    full = torch.arange(16.0).reshape(4, 4)
    (x,), kwargs = prepare_inputs((full.chunk(2)[rank],), {"mask": full},
                                  prepare_in(Shard(0), desired=Replicate(), local=True,
                                             kwargs={"mask": Replicate()}), m)
    assert torch.equal(x, full) and isinstance(kwargs["mask"], torch.Tensor)
    y, z = prepare_outputs((full, full), prepare_out(Shard(1), None, given=(Replicate(), None),
                                                     local=False), m)
    assert y.placements == (TShard(1),) and torch.equal(y.to_local(), full.chunk(2, dim=1)[rank])
    assert z is full
    try:
        prepare_inputs((x,), {}, colwise(), m)
        raise AssertionError("no error")
    except TypeError as error:
        assert str(error) == ("prepare_inputs: 'spec' must be a prepare_in(...) style or the "
                              "spec a mounted module holds (got colwise()).")
    try:
        prepare_inputs(("text",), {}, prepare_in(Shard(0)), m)
        raise AssertionError("no error")
    except TypeError as error:
        assert str(error).startswith("input 0 of prepare_inputs is declared Shard(dim=0) but is str")
    return True


def test_prepare_in_and_prepare_out_styles_are_specs(ranks2):
    assert all(ranks2.run(_styles_as_specs))
