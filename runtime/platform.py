"""Pick the JAX platform (cpu, gpu, tpu, metal) a library user asks for, before the engine is built.

JAX fixes its backends the first time anything runs on a device, so the choice is made by setting
``jax_platforms`` first and then checking that JAX's default backend really is the requested one:

1. The requested platform goes first in ``jax_platforms`` and ``cpu`` after it (host-side work),
   so the requested one becomes JAX's default backend when it initializes.
2. When it cannot initialize (no such hardware or plugin), the previous ``jax_platforms`` is put
   back and ``DeviceUnavailableError`` names the platform and the ones that are available.
3. When JAX already runs in this process on another default backend, the setting cannot take
   effect any more; that is the same error, telling the user to choose before JAX first runs.
"""

from __future__ import annotations

import jax

# The names users pass -> (the jax_platforms entry, the name jax.default_backend() reports).
PLATFORMS: dict[str, tuple[str, str]] = {
    "cpu": ("cpu", "cpu"),
    "gpu": ("cuda", "gpu"),
    "tpu": ("tpu", "tpu"),
    "metal": ("METAL", "METAL"),
}


class DeviceUnavailableError(RuntimeError):
    """The requested platform cannot run the engine in this process."""


def check_device_name(device: str) -> str:
    """The lower-cased platform name; ``ValueError`` naming the choices for anything else."""
    name = device.lower()
    if name not in PLATFORMS:
        raise ValueError(f"device must be one of {', '.join(PLATFORMS)}, got {device!r}")
    return name


def available_platforms() -> list[str]:
    """The platforms of ``PLATFORMS`` that JAX has devices for in this process (initializes JAX)."""
    found = []
    for name, (_, backend) in PLATFORMS.items():
        try:
            if jax.devices(backend):
                found.append(name)
        except RuntimeError:  # JAX's answer for a platform it has no backend for
            continue
    return found


def select_platform(device: str) -> str:
    """Make ``device`` JAX's default backend and return its name; call before building an engine.

    Raises ``ValueError`` for an unknown name and ``DeviceUnavailableError`` when the platform
    cannot be used (not present, or JAX already runs on another platform in this process).
    """
    name = check_device_name(device)
    entry, backend = PLATFORMS[name]
    previous = jax.config.jax_platforms
    jax.config.update("jax_platforms", entry if name == "cpu" else f"{entry},cpu")
    try:
        current = jax.default_backend()
    # RuntimeError: the platform failed to initialize. AssertionError: JAX asserts that it found
    # a default backend, which it does not when the only platform listed has no plugin.
    except (RuntimeError, AssertionError):
        jax.config.update("jax_platforms", previous)
        raise DeviceUnavailableError(
            f"device {name!r} is not available; JAX can use: {_listed(available_platforms())}"
        ) from None
    if current.lower() != backend.lower():
        jax.config.update("jax_platforms", previous)
        available = available_platforms()
        if name not in available:
            raise DeviceUnavailableError(
                f"device {name!r} is not available; JAX can use: {_listed(available)}"
            )
        raise DeviceUnavailableError(
            f"device {name!r} cannot be selected: JAX already runs on {current!r} in this process "
            f"(available: {_listed(available)}); choose the device before anything else uses "
            f"JAX, or set JAX_PLATFORMS={entry} in the environment"
        )
    return name


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "none"
