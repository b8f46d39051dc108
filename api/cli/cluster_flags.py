"""The multi-node flags of ``runtime-serve`` (``runtime.parallel.multihost``): one model over several hosts.

Every host runs ``runtime-serve`` with the same model and engine flags plus its own
``--node-rank``; rank 0 serves HTTP, the others follow its schedule and serve nothing.
"""

from __future__ import annotations

import argparse

from jax_llm_runtime.runtime.parallel.multihost import ClusterConfig

DEFAULT_MASTER_PORT = 29500  # candle-vllm's


def _coordinator_address(args: argparse.Namespace) -> str | None:
    """``--coordinator-address``, else candle-vllm's ``--master-addr`` and ``--master-port``."""
    master_addr = getattr(args, "master_addr", None)
    master_port = getattr(args, "master_port", None)
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"--master-port must be a TCP port in 1..65535, got {master_port}")
    if args.coordinator_address is not None:
        if master_addr is not None:
            raise ValueError("give --coordinator-address or --master-addr, not both")
        return args.coordinator_address
    if master_addr is None:
        if master_port is not None:
            raise ValueError("--master-port needs --master-addr (or --coordinator-address)")
        return None
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"{host}:{master_port or DEFAULT_MASTER_PORT}"


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
    add(
        "--master-addr",
        default=None,
        metavar="HOST",
        help="candle-vllm's spelling: --master-addr HOST --master-port PORT = "
        "--coordinator-address HOST:PORT",
    )
    add(
        "--master-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"with --master-addr: the coordinator's port (default: {DEFAULT_MASTER_PORT})",
    )


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The flags as a ``ClusterConfig``; a ValueError names a bad one."""
    cluster = ClusterConfig(args.num_nodes, args.node_rank, _coordinator_address(args))
    if cluster.multi and getattr(args, "mock_engine", False):
        raise ValueError("--num-nodes > 1 serves a real model; drop --mock-engine")
    if cluster.multi and getattr(args, "models_config", None):
        raise ValueError("--num-nodes > 1 serves one model; drop --models-config")
    return cluster
