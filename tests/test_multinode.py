"""Two nodes on one machine (issue 67): two torchrun agents on localhost, 2 ranks each, meet through torch's c10d
rendezvous, as two machines would; cp-train's a2a+p2p levels follow the node boundary by default (a2a over each node's
ranks, p2p across the nodes) and every step equals one process (--check-parity)."""

import os
import socket
import subprocess
import sys

from conftest import HANG_GUARD_S
from test_cli import SMALL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_hierarchical_levels_follow_the_node_boundary_and_equal_one_process():
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}", "--node-rank", str(node),
         "-m", "cp_handler.cli.train", "--cp-size", "4", "--cp-comm-type", "a2a+p2p", *SMALL, "--check-parity"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for node in (0, 1)]
    logs = [agent.communicate(timeout=HANG_GUARD_S)[1] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n\n".join(log[-2000:] for log in logs)
    first = next(log for log in logs if "parity passed" in log)  # rank 0's node prints the run's lines
    assert "--hierarchical-cp-sizes 2 2 from the node boundary (2 ranks per node" in first, first[-3000:]
    assert "level 0 (size 2): [[0, 1], [2, 3]]; level 1 (size 2): [[0, 2], [1, 3]]" in first, first[-3000:]
    assert "world 4 = dp 1 x cp 4" in first and "cp_comm_type a2a+p2p" in first
