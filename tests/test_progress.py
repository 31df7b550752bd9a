"""Progress bars on rank 0 and the ``tpfn`` logger's lines for checkpoints and verify."""

import contextlib
import io
import logging
import os

import torch
import torch.nn as nn

import tpfn
from tests.ranks import mesh
from tpfn.training.pretrained import empty_weights, load_pretrained, save_pretrained
from tpfn.training.progress import enabled


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


PLAN = {"0": tpfn.colwise(), "2": tpfn.rowwise()}


def _captured(fn, *args, **kwargs) -> tuple:
    """(what ``fn`` wrote to stderr, the ``tpfn`` logger's lines at DEBUG)."""
    stderr, lines = io.StringIO(), []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("tpfn")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with contextlib.redirect_stderr(stderr):
            fn(*args, **kwargs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return stderr.getvalue(), lines


def _checkpoint_progress(directory: str):
    model = tpfn.parallelize(_model(), mesh(2), PLAN)
    saved, said = _captured(save_pretrained, model, directory, max_shard_size=2150)  # 4 tensors, 3 files
    with empty_weights():
        empty = tpfn.parallelize(_model(), mesh(2), PLAN, src_rank=None)
    loaded, told = _captured(load_pretrained, empty, directory)
    quiet, _ = _captured(load_pretrained, empty, directory, progress=False)
    os.environ["TPFN_PROGRESS"] = "0"
    try:
        off, _ = _captured(load_pretrained, empty, directory)
    finally:
        del os.environ["TPFN_PROGRESS"]
    return saved, said, loaded, told, quiet + off


def test_checkpoints_show_progress_on_rank_0_over_every_file(ranks2, tmp_path):
    (saved, said, loaded, told, off), rank1 = ranks2.run(_checkpoint_progress, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                            "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    # the whole model's bytes written (float32: 4 * (512 + 32 + 512 + 16)), this rank's read
    assert "save_pretrained: 100%" in saved and "4.29k/4.29k" in saved and "file 3/3" in saved
    assert "load_pretrained: 100%" in loaded and "2.18k/2.18k" in loaded and "4/4 tensors, 3/3 files" in loaded
    assert off == ""  # progress=False, TPFN_PROGRESS=0
    assert rank1[0] == rank1[2] == ""  # rank 1 shows nothing; both log
    assert said[-1].startswith(f"save_pretrained: 4 tensors (4.3 kB) in 3 files to {tmp_path} in ")
    assert told[-1].startswith(f"load_pretrained: 4 tensors from 3 files of {tmp_path}, this rank's slices "
                               "(2.2 kB), in ")
    assert "load_pretrained: '0.weight' from model-00001-of-00003.safetensors, this rank's (16, 16) of (32, 16)" \
        in told  # at DEBUG, tensor by tensor
    assert rank1[3][-1].startswith("load_pretrained: 4 tensors from 3 files")


def test_progress_is_on_alone_and_follows_the_switches(monkeypatch):
    assert enabled(None) and not enabled(False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' switch, honoured
    assert not enabled(None) and enabled(True)


def test_verify_shows_its_steps_and_logs_its_outcome():
    shown, lines = _captured(tpfn.verify, _model(), PLAN, (4, 16), dtype=torch.float32)
    assert "verify: 100%" in shown and "3/3" in shown
    assert lines[-1].startswith("verify: 4 modules on 2 ranks against one device: ok, in ")
