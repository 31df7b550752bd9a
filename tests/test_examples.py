"""The example scripts run, on the test ranks, as their users would run them."""

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _example(name: str, *args):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    module = __import__(name)
    return module.main(*args)


def _own_directory(name: str, root: str):
    """As under torchrun: every process makes a temporary directory of its own."""
    import torch.distributed as dist

    mine = os.path.join(root, f"rank{dist.get_rank()}")
    os.makedirs(mine)
    _example(name, mine)
    return sorted(os.listdir(mine))


def test_dp_x_tp_training_resumes_at_another_tp_degree(ranks4, tmp_path):
    # main() asserts that the resumed losses continue the uninterrupted ones; the ranks
    # agree on rank 0's directory.
    found = ranks4.run(_own_directory, "train_dp_tp", str(tmp_path))
    assert found == [["step-4"], [], [], []]


def test_the_demo_matches_one_process(ranks2):
    # main() raises SystemExit when the tensor-parallel losses leave the single-process ones.
    ranks2.run(_example, "train_llama", 8, 4, 32, False)
    ranks2.run(_example, "train_llama", 8, 4, 31, True)  # sequence parallel, uneven length


def test_the_demo_compares_loss_curves_as_a_user_would():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    compare = __import__("train_llama")._compare
    single = [5.0 * 0.98 ** i for i in range(300)] + [1e-3, 2e-4]
    near_zero = single[:-2] + [3e-3, 1e-4]  # 200% apart, but a few thousandths of the first loss
    assert compare(near_zero, single) is None
    off_early = [single[0] * 1.01] + single[1:]  # 1% off at the first step
    assert compare(off_early, single) == "the tensor-parallel run does not match the single-process run"
    off_late = single[:-1] + [1.0]  # a fifth of the first loss apart at the end
    assert compare(off_late, single) is not None
