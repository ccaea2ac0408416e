"""A build joining a running Ray cluster of two nodes (on this machine), one node lost while
its worker reads a document: the build finishes with every token once and verifies."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from helpers import files_of
from ray.cluster_utils import Cluster

from landmark_memory.app.cli import main
from landmark_memory.training.data import SAMPLE_DIR

pytestmark = pytest.mark.slow  # Ray clusters of several processes


@pytest.fixture
def cluster():
    """A head node of 2 CPUs and a worker node of 1, which notice a lost node within seconds."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, "_system_config": {
        "health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 2}})
    node = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c, node
    ray.shutdown()
    c.shutdown()


def parent(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_node_lost_mid_build_costs_nothing_but_time(cluster, tmp_path, capsys):
    c, node = cluster
    for name in ("treasure_island_excerpt.txt", "sherlock_holmes_excerpt.txt"):
        (tmp_path / name).write_text((SAMPLE_DIR / "train" / name).read_text())
    mem, rc = tmp_path / "m", []
    argv = ["build", str(mem), "--input", str(tmp_path), "--chunk-size", "100", "--commit-every", "0", "--quiet"]
    build = threading.Thread(target=lambda: rc.append(main(argv + ["--workers", "2", "--worker-threads", "1",
                                                                   "--ray-address", c.address])))
    build.start()
    raylet = node.all_processes["raylet"][0].process.pid
    deadline, lost = time.time() + 300, False
    while not lost and build.is_alive() and time.time() < deadline:  # the worker node's document, under way
        for doc in (mem / "docs").glob("*") if (mem / "docs").is_dir() else []:
            try:
                read = json.loads((doc / "manifest.json").read_text())["inputs"][0]["ingested"]
                pid = int((doc / "writer.lock").read_text().split()[1])
                on_node = parent(pid) == raylet
            except (OSError, ValueError, IndexError, KeyError):
                continue
            if on_node and read > 0:
                c.remove_node(node, allow_graceful=False)
                lost = True
                break
        time.sleep(0.02)
    build.join(timeout=300)
    assert lost, f"a worker on the second node should have been reading when it was lost (build: {rc})"
    assert rc == [0]
    assert main(["info", str(mem), "--verify"]) == 0
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv[:1] + [str(tmp_path / "clean")] + argv[2:]) == 0
    finally:
        torch.set_num_threads(threads)
    assert files_of(mem) == files_of(tmp_path / "clean")  # every token once


def test_a_memory_folder_the_workers_cannot_see_is_refused_before_anything_is_written(tmp_path):
    """The cluster's processes run in a mount namespace where the memory's folder is another,
    empty filesystem: like a folder on the driver's own disk, out of the workers' reach."""
    hidden = tmp_path / "shared"
    hidden.mkdir()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = [ray_bin, "start", "--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard", "false",
            "--disable-usage-stats"]
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs tmpfs {hidden} && exec {' '.join(head)}"], capture_output=True).returncode:
        pytest.skip("cannot start a Ray head in a mount namespace of its own here")
    try:
        (tmp_path / "doc.txt").write_text("A short document.")
        run = subprocess.run([sys.executable, "-m", "landmark_memory.app.entry", "build", str(hidden / "mem"),
                              "--input",
                              str(tmp_path / "doc.txt"), "--workers", "1", "--ray-address", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run([ray_bin, "stop"], capture_output=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("(a shared disk mounted at the same path on every machine)")
    assert "cannot see" in run.stderr and list(hidden.iterdir()) == []
