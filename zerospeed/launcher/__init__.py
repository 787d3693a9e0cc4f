"""The ``zerospeed`` launcher: DeepSpeed's launch command lines, run by zerospeed.

Pure pieces (hostfile, resources, world, environment, runners, plan) are separate from process
handling (local, node, multinode) and the command line (cli).
"""

from zerospeed.launcher.environment import UserCommand, omp_num_threads, rank_argv, rank_environment
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.hostfile import parse_hostfile, read_hostfile
from zerospeed.launcher.resources import filter_resources, limit_resources
from zerospeed.launcher.world import NodeLayout, node_layout

__all__ = [
    "LauncherError",
    "NodeLayout",
    "UserCommand",
    "filter_resources",
    "limit_resources",
    "node_layout",
    "omp_num_threads",
    "parse_hostfile",
    "rank_argv",
    "rank_environment",
    "read_hostfile",
]
