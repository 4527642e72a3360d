"""Tests that start network servers (Ray, torch.distributed's gloo) run their command in a network namespace of its
own with only loopback up (``unshare --user --net``): Ray and gloo listen on every interface of their host, and
there the only one is ``lo``. While the command runs, ``ss -tlnp`` is polled on this host: a listener of any of its
processes fails the test.

Without unprivileged user namespaces such a test fails and says so; DDTE_TESTS_ANY_NETWORK=1 runs the commands on
this host's network instead (their servers then listen on it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ANY_NETWORK = "DDTE_TESTS_ANY_NETWORK"
NAMESPACE = ["unshare", "--user", "--map-root-user", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
# gloo binds the address the host name resolves to, which the namespace does not have: loopback instead
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


def namespace_works() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    return subprocess.run([*NAMESPACE, "true"], capture_output=True, timeout=30).returncode == 0


def run_loopback_only(argv: list[str], cwd: Path, timeout: float = 600, env: dict | None = None) -> tuple[int, str]:
    """Run ``argv`` in a loopback-only network namespace; (exit code, stdout and stderr together). Fails the test
    when the namespace cannot be made (unless DDTE_TESTS_ANY_NETWORK=1) or when a process of the command listens on
    this host's network."""
    isolated = namespace_works()
    if not isolated and os.environ.get(ANY_NETWORK) != "1":
        pytest.fail("this test needs a network namespace of its own (unshare --user --net, and ip); set "
                    f"{ANY_NETWORK}=1 to run it on this host's network")
    proc = subprocess.Popen([*NAMESPACE, *argv] if isolated else argv, cwd=cwd, text=True,
                            env={**os.environ, **LOOPBACK_ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    found: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_listeners, args=(proc.pid, found, stop), daemon=True)
    if shutil.which("ss"):
        watcher.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not found, f"processes of {argv[:4]} listened on this host's network: {found[:3]}"
    return proc.returncode, output


def _watch_listeners(root: int, found: list[str], stop: threading.Event) -> None:
    """Every 0.3 s until ``stop``: the TCP listeners on this host's network owned by ``root`` or its descendants."""
    while not stop.wait(0.3):
        lines = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout.splitlines()
        found.extend(line for line in lines
                     if any(_descends_from(int(pid), root) for pid in re.findall(r"pid=(\d+)", line)))


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid: field 4, after the name in parentheses
    return False
