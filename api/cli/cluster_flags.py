"""The multi-node flags of ``runtime-serve`` (``runtime.parallel.multihost``): one model over several hosts.

Every host runs ``runtime-serve`` with the same model and engine flags plus its own
``--node-rank``; rank 0 serves HTTP, the others follow its schedule and serve nothing.
"""

from __future__ import annotations

import argparse

from jax_llm_runtime.runtime.parallel.multihost import ClusterConfig


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-node",
        "one model over several hosts: run the same command on every host, each with its own "
        "--node-rank; --tensor-parallel-size counts the devices of all of them",
    )
    add = group.add_argument
    add(
        "--num-nodes",
        type=int,
        default=1,
        help="processes (hosts) serving the model together (default: %(default)s)",
    )
    add(
        "--node-rank",
        type=int,
        default=0,
        help="this process's rank, 0 to --num-nodes - 1; rank 0 serves HTTP (default: %(default)s)",
    )
    add(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="where rank 0 runs JAX's coordinator service (a free port on rank 0's host); the "
        "same on every node (required with --num-nodes > 1)",
    )


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The flags as a ``ClusterConfig``; a ValueError names a bad one."""
    cluster = ClusterConfig(args.num_nodes, args.node_rank, args.coordinator_address)
    if cluster.multi and getattr(args, "mock_engine", False):
        raise ValueError("--num-nodes > 1 serves a real model; drop --mock-engine")
    if cluster.multi and getattr(args, "models_config", None):
        raise ValueError("--num-nodes > 1 serves one model; drop --models-config")
    return cluster
