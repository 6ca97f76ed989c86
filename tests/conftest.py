import os

import pytest

# Quiet TensorFlow's C++ start-up chatter in test output; set before import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The shared helpers' asserts (tests/helpers/) report the values they
# compared when they fail, as a test module's own asserts do.
pytest.register_assert_rewrite("helpers")
