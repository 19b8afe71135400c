"""The device mesh ``("sp", "tp")`` and the axis names every PartitionSpec uses."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

SP = "sp"
TP = "tp"
# Head blocks are split over this tuple in every spec and collective: device (s, t) owns
# block t * sp + s, which is also the block the Ulysses all-to-all over "sp" hands it.
HEAD_AXES = (TP, SP)


def make_mesh(sp: int, tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of shape ``(sp, tp)`` over ``devices`` (default: the first ``sp * tp``)."""
    if sp <= 0 or tp <= 0:
        raise ValueError(f"sp and tp must be positive, got sp={sp}, tp={tp}")
    if devices is None:
        devices = jax.devices()
    if len(devices) < sp * tp:
        raise ValueError(
            f"sp * tp = {sp * tp} devices are needed but only {len(devices)} are available"
        )
    grid = np.asarray(devices[: sp * tp], dtype=object).reshape(sp, tp)
    # Auto axes: placements are explicit (NamedSharding on every array), and shard_map
    # in_specs are read off the arrays, so nothing is resharded behind our back.
    return Mesh(grid, (SP, TP), axis_types=(jax.sharding.AxisType.Auto,) * 2)
