"""Hypothesis settings for the unit suite.

No per-example deadline: a property's examples are bounded by their strategies, and a deadline
only measures how loaded the machine is (CI once failed a 347 ms example against the default
200 ms). The suite's own bound is pytest-timeout's, per test.
"""

from hypothesis import settings

settings.register_profile("swarmtrain", deadline=None)
settings.load_profile("swarmtrain")
