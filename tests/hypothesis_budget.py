"""Hypothesis example counts, governed by HYPOTHESIS_PROFILE (``ci``, the default: 200, derandomized;
``dev``: 100; ``thorough``: 2,000).  A test asks for a share of the profile's count, so one variable scales them all."""

import os

from hypothesis import settings

# ci draws the same examples on every run (derandomize), so the suite cannot pass or fail by luck;
# dev and thorough explore, and every case they find is pinned as an explicit example.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def profile_examples(share: int) -> int:
    """A test's example count as ``1/share`` of the loaded profile's: a larger share for tests whose
    every example costs more (a real framework driven, a program compiled)."""
    return max(2, settings.default.max_examples // share)
