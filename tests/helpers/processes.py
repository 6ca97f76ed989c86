"""Fresh Python processes, and worker processes on localhost for
MultiWorkerMirroredStrategy tests.

`run_python` runs one process from the repository root, `run_program` a
program in a directory of its own, as a reader runs it; `script(name)` is
the path of a subprocess script in tests/scripts/. This is the one place
that starts clusters: free ports, a TF_CONFIG per worker, and, for fault
injection, stopping a worker at a named point of its program and killing
it there. A worker script marks a point with `pause_at(name)`: when the
test asked for that point (env `PAUSE_AT`, for the worker `PAUSE_TASK`),
the worker writes `reached-<name>` into `SIGNAL_DIR` and waits there until
the test kills it or writes `go`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.project import ROOT

# The scripts tests start in processes of their own.
SCRIPTS = ROOT / "tests" / "scripts"

# What a worker may wait for before giving up: every wait is bounded.
WAIT = 300


def environment(**env):
    """This process's environment, with the repository importable, plus
    `env`; a native crash (TensorFlow's) prints every thread's Python
    traceback (faulthandler), so its report names the line."""
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": pythonpath, "PYTHONFAULTHANDLER": "1", **env}


# Set by tests/conftest.py for the out-of-memory tests' speed; a reader's
# Python does not have it.
_TESTS_ONLY = ("TF_ONEDNN_USE_SYSTEM_ALLOCATOR",)


def script(name):
    """The path (a str) of tests/scripts/`name`, to pass to `run_python`."""
    path = SCRIPTS / name
    assert path.is_file(), path
    return str(path)


def run_python(*args, timeout=600, **env):
    """Runs a fresh Python (`python *args`) from the repository root, with the
    repository importable; returns the CompletedProcess (text output)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(**env),
    )


def run_program(code, workdir, timeout=600):
    """Runs `code` as a reader would: saved as `program.py` in `workdir` (an
    empty directory) and run there by a fresh `python program.py`, with the
    repository importable and temporary files in `workdir` too, without the
    tests' own settings (`_TESTS_ONLY`); returns the CompletedProcess (text
    output)."""
    workdir = Path(workdir)
    (workdir / "program.py").write_text(code)
    env = environment(TF_CPP_MIN_LOG_LEVEL="3", TMPDIR=str(workdir))
    for name in _TESTS_ONLY:
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "program.py"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_configs(workers):
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(workers)]}
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(workers)
    ]


class Cluster:
    """`python *args` started once per worker; output goes to files in `logs`.

    Output to files rather than pipes: a test that waits for one worker
    must not block another on a full pipe.
    """

    def __init__(self, *args, logs, workers=2, **env):
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes = []
        for i, config in enumerate(tf_configs(workers)):
            with open(self.logs / f"out-{i}", "w") as out, open(self.logs / f"err-{i}", "w") as err:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, *args],
                        cwd=ROOT,
                        stdout=out,
                        stderr=err,
                        text=True,
                        env=environment(TF_CONFIG=config, **env),
                    )
                )

    def output(self, i):
        return (self.logs / f"out-{i}").read_text()

    def error(self, i):
        return (self.logs / f"err-{i}").read_text()

    def wait(self, i, timeout):
        """Worker `i`'s exit code; kills it (and returns None) after `timeout` s."""
        try:
            return self.processes[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(i)
            return None

    def kill(self, i):
        process = self.processes[i]
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def close(self):
        # A worker whose peer died may wait on its collectives.
        for i in range(len(self.processes)):
            self.kill(i)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for_file(path, timeout, processes=()):
    """Waits until `path` exists; False on timeout or if all `processes` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(path).exists():
            return True
        if processes and all(p.poll() is not None for p in processes):
            return Path(path).exists()
        time.sleep(0.05)
    return False


def run_workers(*args, workers=2, timeout=600, logs=None, **env):
    """Runs `python *args` as each worker of a cluster on localhost, to the end.

    Returns the workers' CompletedProcess results, in index order (a worker
    still running after `timeout` s is killed: returncode None).
    """
    import tempfile

    logs = logs or tempfile.mkdtemp(prefix="workers-")
    with Cluster(*args, logs=logs, workers=workers, **env) as cluster:
        deadline = time.monotonic() + timeout
        codes = [cluster.wait(i, max(1.0, deadline - time.monotonic())) for i in range(workers)]
        return [
            subprocess.CompletedProcess(
                cluster.processes[i].args, codes[i], cluster.output(i), cluster.error(i)
            )
            for i in range(workers)
        ]


# -- inside a worker ------------------------------------------------------------


def task_index():
    return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])


def pause_at(name):
    """Stops here if the test asked for point `name` on this worker."""
    if os.environ.get("PAUSE_AT") != name:
        return
    if int(os.environ.get("PAUSE_TASK", "-1")) != task_index():
        return
    signals = Path(os.environ["SIGNAL_DIR"])
    (signals / f"reached-{name}").write_text(str(time.time()))
    wait_for_file(signals / "go", WAIT)
