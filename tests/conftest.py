from __future__ import annotations

import pytest

from queueing.profile import IterationProfile
from tests.profiles import TEST_8B


@pytest.fixture
def profile() -> IterationProfile:
    """The shared hand-written test profile (``tests.profiles.TEST_8B``)."""
    return TEST_8B
