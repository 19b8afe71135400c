"""Restoring a shiftjax checkpoint onto devices, straight into the wanted shardings."""

from __future__ import annotations

from pathlib import Path

from shiftjax.checkpoints.format import CONFIG_FILE, PARAMS_DIR, CheckpointError, nest, read_marker, unnest
from shiftjax.config import ConfigError, ModelConfig
from shiftjax.params import Params, param_shapes, params_from_flat


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a complete checkpoint."""
    path = Path(path)
    read_marker(path)
    try:
        return ModelConfig.from_json_file(path / CONFIG_FILE)
    except ConfigError as error:
        raise CheckpointError(f"{path / CONFIG_FILE}: {error}") from None


def load_checkpoint(path: str | Path, *, dtype=None, shardings=None) -> tuple[ModelConfig, Params]:
    """Restores ``(config, params)`` from a checkpoint written by ``convert_hf_checkpoint``.

    ``dtype``: None keeps the stored dtype; otherwise every weight is cast on restore
    (e.g. "float32" or ``jnp.bfloat16``). ``shardings``: a Params-shaped pytree of
    ``jax.sharding.Sharding`` that each array is restored into directly (no host copy of
    the whole model, no resharding afterwards); also accepted: one Sharding for every
    tensor, or a dict keyed by ``param_shapes`` paths (``"layers.wq"``). None means the
    default device.
    """
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    info = read_marker(path)
    config = load_config(path)
    shapes = param_shapes(config)
    stored = info.get("tensors", {})
    for name, shape in shapes.items():
        if name in stored and tuple(stored[name]) != shape:
            raise CheckpointError(
                f"{path / 'shiftjax.json'} records {name} as {stored[name]}, but config.json "
                f"implies {list(shape)}; the checkpoint is inconsistent, convert it again"
            )
    target_dtype = jnp.dtype(dtype if dtype is not None else info.get("dtype", "float32"))
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        flat_shardings = {name: shardings for name in shapes}
    elif isinstance(shardings, dict):
        flat_shardings = unnest(shardings)
    else:
        from shiftjax.params import params_to_flat

        flat_shardings = params_to_flat(shardings)
    if set(flat_shardings) != set(shapes):
        raise CheckpointError(
            f"shardings names the tensors {sorted(flat_shardings)}, but the checkpoint has "
            f"{sorted(shapes)}"
        )
    abstract = nest(
        {
            name: jax.ShapeDtypeStruct(shape, target_dtype, sharding=flat_shardings[name])
            for name, shape in shapes.items()
        }
    )
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / PARAMS_DIR, abstract)
    except (FileNotFoundError, ValueError, KeyError) as error:
        raise CheckpointError(f"cannot restore the weights in {path / PARAMS_DIR}: {error}") from error
    return config, params_from_flat(unnest(restored))


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (see ``shiftjax.checkpoints.tokenizer.Tokenizer``)."""
    from shiftjax.checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)
