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
