import os

import pytest

# Quiet TensorFlow's C++ start-up chatter in test output; set before import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The shared helpers' asserts (tests/helpers/) report the values they
# compared when they fail, as a test module's own asserts do.
pytest.register_assert_rewrite("helpers")

# Module fixtures that run a script in processes of their own (a minute or
# more each). pytest-xdist sets a module fixture up in every worker that
# runs one of its tests, so under `-n 2` each ran twice. The tests of one
# such fixture and parameter go to one worker (`--dist loadgroup`, in
# setup.cfg); every other test is spread as before.
PROCESS_FIXTURES = {
    "tests/test_auto_replicas.py": ("runs",),
    "tests/test_distributed.py": ("mirrored", "workers"),
    "tests/test_noise_scale.py": ("mirrored",),
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::")[0]
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in PROCESS_FIXTURES.get(path, ()):
            if name in getattr(item, "fixturenames", ()):
                # No "]" or "@" in a group's name: xdist reads the group
                # from the node id after the last "@", if no "]" follows.
                group = f"{path}::{name}:{params.get(name, '')}"
                item.add_marker(pytest.mark.xdist_group(group))
