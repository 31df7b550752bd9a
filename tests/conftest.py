import os

import pytest
from hypothesis import HealthCheck, settings

from tests.ranks import Ranks

settings.register_profile(
    "tpfn-ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("tpfn-dev", max_examples=100, deadline=None)
settings.register_profile("tpfn-thorough", max_examples=3000, deadline=None)
# torch.testing._internal (the reference Transformer's home) loads a hypothesis profile of
# its own when imported; import it first, so that ours is the one @given sees.
import torch.testing._internal.common_utils  # noqa: E402, F401

settings.load_profile("tpfn-" + os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks on 127.0.0.1, started once per session."""
    with Ranks(2) as ranks:
        yield ranks


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks on 127.0.0.1, started once per session."""
    with Ranks(4) as ranks:
        yield ranks
