"""tpfn: tensor parallelism for PyTorch as a small functional language.

Layouts (``Shard``, ``Replicate``, ``Partial``), styles composed with ``>>``, plans from
module FQN patterns to styles, and one interpreter, ``parallelize``.
"""

import importlib.metadata as _metadata

from tpfn import algebra, checkpoint, kernels, record, rng, trace
from tpfn.adapters.from_hf import from_hf
from tpfn.adapters.from_torch import from_torch
from tpfn.adapters.lora import with_lora
from tpfn.analysis.check import Check, check
from tpfn.dryrun.explain import explain
from tpfn.dryrun.report import Report
from tpfn.dryrun.verify import verify
from tpfn.errors import CheckpointError, CollectiveError, LayoutError, PlanError, StyleError
from tpfn.interpret.parallelize import mounted, parallelize
from tpfn.interpret.prepare import prepare_inputs, prepare_outputs, shard_params
from tpfn.layout import Partial, Replicate, Shard, to_torch
from tpfn.plans.plan import Plan, plan, resolve
from tpfn.style.constructors import (colwise, identity, on_shards, params, per_rank, prepare_in,
                                     prepare_out, replicate, rowwise, sequence_parallel)
from tpfn.style.style import Style
from tpfn.suggest.suggest import suggest
from tpfn.training.clip import clip_grad_norm_
from tpfn.training.hf import causal_lm_loss, for_accelerate
from tpfn.training.loss import cross_entropy
from tpfn.training.optim import param_groups
from tpfn.training.pretrained import empty_weights, from_pretrained, load_pretrained, save_pretrained

try:
    __version__ = _metadata.version("tpfn")
except _metadata.PackageNotFoundError:  # run from a checkout that is not installed: pyproject.toml's
    __version__ = "0.1.0"

__all__ = [
    "Shard", "Replicate", "Partial", "to_torch", "from_torch",
    "Style", "colwise", "rowwise", "sequence_parallel", "on_shards", "replicate", "params",
    "prepare_in", "prepare_out", "per_rank", "identity",
    "Plan", "plan", "resolve",
    "parallelize", "mounted", "shard_params", "prepare_inputs", "prepare_outputs",
    "cross_entropy", "causal_lm_loss", "clip_grad_norm_", "param_groups", "for_accelerate",
    "from_pretrained", "load_pretrained", "save_pretrained", "empty_weights", "CheckpointError", "from_hf",
    "with_lora",
    "explain", "Report", "verify", "suggest", "check", "Check",
    "PlanError", "LayoutError", "StyleError", "CollectiveError",
    "algebra", "checkpoint", "record", "rng", "trace"]
