"""tpfn: tensor parallelism for PyTorch as a small functional language.

Layouts (``Shard``, ``Replicate``, ``Partial``), styles composed with ``>>``, plans from
module FQN patterns to styles, and one interpreter, ``parallelize``.
"""

from tpfn import algebra, checkpoint, record, rng, trace
from tpfn.dryrun import explain
from tpfn.errors import CollectiveError, LayoutError, PlanError, StyleError
from tpfn.fns import prepare_inputs, prepare_outputs, shard_params
from tpfn.grads import clip_grad_norm_
from tpfn.hf import from_hf
from tpfn.interpret import mounted, parallelize
from tpfn.layout import Partial, Replicate, Shard, to_torch
from tpfn.loss import cross_entropy
from tpfn.plan import Plan, plan, resolve
from tpfn.report import Report
from tpfn.style import (
    Style,
    colwise,
    identity,
    on_shards,
    params,
    prepare_in,
    prepare_out,
    replicate,
    rowwise,
    sequence_parallel,
)
from tpfn.torch_styles import from_torch

__all__ = [
    "Shard", "Replicate", "Partial", "to_torch", "from_torch",
    "Style", "colwise", "rowwise", "sequence_parallel", "on_shards", "replicate", "params",
    "prepare_in", "prepare_out", "identity",
    "Plan", "plan", "resolve",
    "parallelize", "mounted", "shard_params", "prepare_inputs", "prepare_outputs",
    "cross_entropy", "clip_grad_norm_",
    "from_hf",
    "explain", "Report",
    "PlanError", "LayoutError", "StyleError", "CollectiveError",
    "algebra", "checkpoint", "record", "rng", "trace",
]
