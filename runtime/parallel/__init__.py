"""Several devices or hosts for one model: tensor parallelism over a device mesh, data-parallel
replicas, JAX's multi-controller runtime across hosts, and which routed experts stay in host
memory per rank.
"""
