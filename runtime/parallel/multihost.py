"""Several processes, one model: JAX's multi-controller runtime across hosts.

1. Every process calls ``initialize`` (``jax.distributed.initialize``) before anything else uses
   JAX; ``jax.devices()`` then lists the devices of every process, and the tensor-parallel mesh
   (``runtime.parallel.sharding``) spans them.
2. Every process builds the same engine from the same flags: the weights and the KV cache are
   placed on the global mesh, each process holding the shards of its own devices.
3. Process 0, the leader, serves HTTP and runs the scheduler. Before each device call of its
   runners (a step, a page fill, a cache-free forward) it sends the call and its host inputs to
   the followers over the schedule channel: one TCP connection per follower, authenticated with
   a random key. The channel's port and key reach the followers through JAX itself
   (``broadcast_one_to_all``) at startup; the address is the coordinator's host, which is
   process 0's.
4. A follower (``follow``) replays each call on its own runners with the same inputs, so every
   process launches the same SPMD programs in the same order; the followers drop the outputs.
5. The leader's ``close`` sends ``stop`` and the followers exit 0; a follower whose channel closes
   without one (the leader died) exits with an error.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_KEY_BYTES = 32
# The calls a follower replays, by runner: everything else on a runner stays on the leader.
_REPLAYED = {
    "runner": ("execute", "fill_page_ids", "copy_state_slots"),
    "embedder": ("forward",),
}
_STOP = "stop"


class ClusterError(RuntimeError):
    """A process of a multi-node run that cannot join or lost its peers."""


@dataclass(frozen=True)
class ClusterConfig:
    """Where this process stands in a multi-node run (``--num-nodes`` and friends)."""

    num_nodes: int = 1
    node_rank: int = 0
    coordinator_address: str | None = None  # host:port of process 0's coordinator service

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"--num-nodes must be >= 1, got {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(
                f"--node-rank must be in [0, {self.num_nodes - 1}], got {self.node_rank}"
            )
        if self.num_nodes > 1:
            if not self.coordinator_address:
                raise ValueError("--num-nodes > 1 needs --coordinator-address host:port")
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"--coordinator-address must be host:port, got {self.coordinator_address!r}"
                )

    @property
    def multi(self) -> bool:
        return self.num_nodes > 1

    @property
    def leads(self) -> bool:
        return self.node_rank == 0

    @property
    def coordinator_host(self) -> str:
        assert self.coordinator_address is not None
        return self.coordinator_address.rpartition(":")[0].strip("[]")


def initialize(cluster: ClusterConfig, timeout_s: int = 300) -> None:
    """Join the run's processes (a no-op for one node). Call before anything else uses JAX."""
    if not cluster.multi:
        return
    import jax

    _native_stdout_to_stderr()
    try:
        jax.distributed.initialize(
            cluster.coordinator_address,
            num_processes=cluster.num_nodes,
            process_id=cluster.node_rank,
            initialization_timeout=timeout_s,
        )
    except Exception as exc:  # the runtime raises bare XlaRuntimeErrors with long texts
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(
            f"cannot join {cluster.num_nodes} processes at {cluster.coordinator_address} "
            f"as rank {cluster.node_rank}: {first}"
        ) from exc
    logger.info(
        "process %d of %d: %d local and %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def finish(cluster: ClusterConfig) -> None:
    """Leave the run together (a no-op for one node): every process calls this once it is done,
    the leader after ``close``, a follower after ``stop``, so none outlives the coordinator."""
    if not cluster.multi:
        return
    import jax

    try:
        jax.distributed.shutdown()
    except Exception as exc:  # a peer already gone: nothing is left to leave cleanly
        logger.warning("leaving the multi-node run: %s", str(exc).strip().splitlines()[0])


def _native_stdout_to_stderr() -> None:
    """Point file descriptor 1 at stderr, and ``sys.stdout`` at the original stdout: the
    collectives library prints its connection notices from native code, and stdout must carry
    only the program's own lines (the ``Serving ...`` line that launchers wait for)."""
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(original, "w", buffering=1, encoding=sys.stdout.encoding)


def _share_address(port: int, key: bytes) -> tuple[int, bytes]:
    """Process 0's (port, key), on every process (a collective: every process calls it)."""
    from jax.experimental import multihost_utils

    message = np.zeros(2 + _KEY_BYTES, np.uint8)
    message[:2] = (port >> 8, port & 0xFF)
    message[2:] = np.frombuffer(key, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(message))
    return int(shared[0]) << 8 | int(shared[1]), shared[2:].tobytes()


class Leader:
    """Process 0's end of the schedule channel: sends each replayed call to every follower."""

    def __init__(self, connections: list[Connection]) -> None:
        self._connections = connections
        self._lock = threading.Lock()  # the engine loop sends; shutdown closes from elsewhere
        self._closed = False

    @classmethod
    def accept(cls, cluster: ClusterConfig, timeout_s: float = 300) -> Leader:
        """Open the channel, tell the followers where it is, and wait for all of them."""
        key = secrets.token_bytes(_KEY_BYTES)
        listener = Listener((cluster.coordinator_host, 0), authkey=key)
        try:
            _share_address(listener.address[1], key)
            connections = []
            timer = threading.Timer(timeout_s, listener.close)
            timer.start()
            try:
                for _ in range(cluster.num_nodes - 1):
                    connections.append(listener.accept())
            except OSError as exc:
                raise ClusterError(
                    f"only {len(connections)} of {cluster.num_nodes - 1} followers connected "
                    f"to the schedule channel within {timeout_s:.0f}s"
                ) from exc
            finally:
                timer.cancel()
        finally:
            listener.close()
        logger.info("schedule channel: %d followers connected", len(connections))
        return cls(connections)

    def attach(self, engine: Any) -> None:
        """Mirror the device calls of ``engine``'s runners to the followers."""
        engine.runner.mirror = self._sender("runner")
        if engine.embedder is not None:
            engine.embedder.mirror = self._sender("embedder")

    def _sender(self, target: str) -> Callable[..., None]:
        def send(method: str, *args: Any) -> None:
            self._send((target, method, args))

        return send

    def _send(self, message: tuple[str, str, tuple[Any, ...]]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._closed:
                raise ClusterError("the schedule channel is closed")
            for connection in self._connections:
                connection.send_bytes(data)

    def close(self) -> None:
        """Tell the followers to stop, and close the channel."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            data = pickle.dumps((_STOP, "", ()))
            for connection in self._connections:
                try:
                    connection.send_bytes(data)
                    connection.close()
                except OSError:
                    pass  # that follower is gone already


def follow(cluster: ClusterConfig, engine: Any) -> None:
    """A follower's life: join the schedule channel, compile, and replay the leader's calls until
    it says stop. Raises ClusterError when the leader goes away without saying it."""
    port, key = _share_address(0, bytes(_KEY_BYTES))
    try:
        connection = Client((cluster.coordinator_host, port), authkey=key)
    except OSError as exc:
        raise ClusterError(
            f"cannot reach the leader's schedule channel at {cluster.coordinator_host}:{port}: "
            f"{exc}"
        ) from exc
    engine.start(loop=False)
    targets = {"runner": engine.runner, "embedder": engine.embedder}
    calls = 0
    try:
        while True:
            try:
                # Only rank 0 can send here: the connection passed the HMAC challenge of
                # the key broadcast through JAX, so unpickling its messages is safe.
                target, method, args = pickle.loads(connection.recv_bytes())
            except (EOFError, OSError) as exc:
                raise ClusterError(
                    f"the leader closed the schedule channel after {calls} calls without "
                    "saying stop (did process 0 die?)"
                ) from exc
            if target == _STOP:
                logger.info("the leader said stop after %d calls", calls)
                return
            if method not in _REPLAYED.get(target, ()) or targets.get(target) is None:
                raise ClusterError(f"the leader sent an unknown call {target}.{method}")
            try:
                getattr(targets[target], method)(*args)
            except Exception:
                # The leader's own call raised too; it reruns the batch's sequences one by one
                # (runtime.engine.core's failure isolation), and those calls come here as well.
                if engine.runner.cache_lost():
                    raise
                logger.exception("a replayed %s.%s failed", target, method)
            calls += 1
    finally:
        connection.close()
