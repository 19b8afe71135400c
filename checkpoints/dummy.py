"""Random weights of a named shape, made on the devices in their final shardings.

``--load-format dummy`` serves a model given only by its Hugging Face ``config.json``;
every GPU benchmark runs this way. The weights never exist on the host nor as a canonical
copy on the devices: each device generates only its own blocks, inside one ``shard_map``
per block array, under ``jit`` with the final ``out_shardings``.

Every value is a function of (seed, canonical tensor, layer, index along the axis the
blocks cut) only, so the model does not depend on the mesh: a padded head is zero, a KV
head duplicated on several devices is the same everywhere, and the same model loads on one
device, on any ``sp x tp`` mesh, or (through :func:`dummy_params` and
:func:`write_checkpoint`) from a checkpoint, bit for bit. Matrices are ``0.02 * N(0, 1)``
(the usual initialiser scale, so bf16 activations stay finite), norms are one.
"""

from __future__ import annotations

import functools
import json
import shutil
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from shiftjax.checkpoints.format import (
    CONFIG_FILE,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER_FILE,
    PARAMS_DIR,
    CheckpointError,
    nest,
    publish,
    staging_dir_for,
)
from shiftjax.config import ConfigError, ModelConfig
from shiftjax.layouts import blocks as blk
from shiftjax.layouts.heads import head_layout
from shiftjax.layouts.mesh import HEAD_AXES
from shiftjax.params import Params, param_shapes, params_from_flat, params_to_flat
from shiftjax.weights import BlockWeight, ModelWeights, Segment, assemble_weights, block_plan, replicated_tensors

WEIGHT_SCALE = 0.02


def read_model_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face ``config.json``, given as the file or its directory."""
    path = Path(model)
    if path.is_dir():
        path = path / CONFIG_FILE
    try:
        return ModelConfig.from_json_file(path)
    except ConfigError as error:
        raise CheckpointError(f"--load-format dummy needs a Hugging Face config.json: {error}") from None


def _tensor_key(seed: int, tensor: str) -> jax.Array:
    # crc32 of the path, not its position in a list, so adding a tensor changes no other.
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(tensor.encode()) & 0x7FFFFFFF)


def _segment_values(key: jax.Array, rows: Int[Array, "n"], other: tuple[int, ...], cut: int, dtype):
    """One layer's slice of a segment: the vector at canonical index ``rows[i]`` along the cut
    axis is ``N(0, 1)`` keyed by that index (zero where ``rows[i] < 0``), scaled and cast."""

    def vector(row):
        return jax.random.normal(jax.random.fold_in(key, jnp.maximum(row, 0)), other, jnp.float32)

    values = jax.vmap(vector)(rows)  # [n, *other]
    valid = (rows >= 0).reshape((-1,) + (1,) * len(other))
    values = jnp.where(valid, WEIGHT_SCALE * values, 0.0).astype(dtype)
    return jnp.moveaxis(values, 0, cut)


def _generate_block(tensors: tuple[str, ...], cut_axis: int, stacked: bool, shapes: dict, rows: list,
                    seed: int, dtype) -> jax.Array:
    """The block whose segments take canonical indices ``rows`` (traced) of ``tensors`` along
    ``cut_axis``; ``stacked`` blocks come with their block axis, ``[layers, 1, ...]``."""
    canonical = shapes[tensors[0]]
    layered = tensors[0].startswith("layers.")
    cut = cut_axis - 1 if layered else cut_axis
    per_layer = canonical[1:] if layered else canonical
    other = tuple(size for axis, size in enumerate(per_layer) if axis != cut)

    def layer_block(layer):
        parts = []
        for tensor, segment_rows in zip(tensors, rows):
            key = _tensor_key(seed, tensor)
            if layered:
                key = jax.random.fold_in(key, layer)
            parts.append(_segment_values(key, segment_rows, other, cut, dtype))
        block = jnp.concatenate(parts, axis=cut)
        # The block axis is added per layer: adding it to the stacked result made XLA keep
        # the stack in a temporary and copy it out (twice the block's memory, on the CPU).
        return block[None] if stacked else block

    if not layered:
        if len(tensors) == 1 and _row_chunks(len(rows[0])) > 1:
            return _chunked_block(_tensor_key(seed, tensors[0]), rows[0], other, cut, dtype)
        return layer_block(None)
    # One layer at a time (lax.map writes each into the stacked output in place), so the
    # float32 temporaries are one layer's block, not the whole stack.
    return lax.map(layer_block, jnp.arange(canonical[0]))


def _row_chunks(rows: int, most: int = 32) -> int:
    """The largest divisor of ``rows`` up to ``most``: how many pieces a vocabulary block is
    generated in."""
    return max(c for c in range(1, most + 1) if rows % c == 0)


def _chunked_block(key: jax.Array, rows: Int[Array, "n"], other: tuple[int, ...], cut: int, dtype) -> jax.Array:
    """A block without layers (the vocabulary's) generated a chunk of rows at a time, so the
    float32 temporaries are a chunk's, not the block's: made whole, XLA's memory analysis on
    the CPU showed temporaries of 4x the block's float32 size (a 70B embedding block at
    tp = 2 holds 4.2 GB of float32 values); in chunks, 0.4x its bf16 size."""
    chunks = _row_chunks(rows.shape[0])
    values = lax.map(lambda chunk: _segment_values(key, chunk, other, 0, dtype), rows.reshape(chunks, -1))
    return jnp.moveaxis(values.reshape(rows.shape[0], *other), 0, cut)


@functools.lru_cache(maxsize=64)
def _block_program(tensors: tuple[str, ...], kind: str, cut_axis: int, shapes: tuple, seed: int, dtype,
                   mesh: Mesh, spec: P):
    """The jitted program making one block array; the index tables are its arguments, so the
    ``sp`` shards of one aliased weight share one executable."""
    stacked = kind != "vocab"
    block_axis = 1 if stacked else cut_axis  # as BlockWeight.block_axis
    axes = spec[block_axis] if len(spec) > block_axis else None

    def local(*tables):
        # The shard position along the block axis; with a tuple of axes, axis_index
        # linearises them in the spec's order, as the sharding does.
        position = 0 if axes is None else lax.axis_index(axes)
        rows = [table[position] for table in tables]
        return _generate_block(tensors, cut_axis, stacked, dict(shapes), rows, seed, dtype)

    local_fn = jax.shard_map(local, mesh=mesh, in_specs=(P(),) * len(tensors), out_specs=spec)
    return jax.jit(local_fn, out_shardings=NamedSharding(mesh, spec))


def _block_maker(mesh: Mesh, shapes: dict, seed: int, dtype):
    def make_blocks(weight: BlockWeight, shape, sharding: NamedSharding, blocks_at):
        program = _block_program(tuple(segment.tensor for segment in weight.segments), weight.kind,
                                 weight.cut_axis, tuple(shapes.items()), seed, dtype, mesh, sharding.spec)
        # [positions, n] canonical indices per segment: small, replicated inputs.
        tables = [np.asarray(segment.index)[np.asarray(blocks_at)].astype(np.int32) for segment in weight.segments]
        replicated = NamedSharding(mesh, P())
        out = program(*[jax.device_put(table, replicated) for table in tables])
        assert out.shape == tuple(shape), (weight.name, out.shape, shape)
        return out

    def make_replicated(name: str, sharding: NamedSharding):
        # The norms are small (a layer's is one row): a transfer, not a program to make.
        return jax.device_put(np.ones(shapes[name], dtype), sharding)

    return make_blocks, make_replicated


def dummy_weights(config: ModelConfig, *, mesh: Mesh, dtype="bfloat16", weight_storage: str = "aliased",
                  seed: int = 0, quantization: str = "none") -> ModelWeights:
    """Random weights of ``config`` in the block layout of ``mesh``, made on the devices.

    Equal, bit for bit, to ``shard_params(dummy_params(config, ...), config, mesh,
    weight_storage)``; device memory holds only the final weights plus one layer's
    temporaries of one block array. ``quantization="fp8"``: each layer GEMM weight is made
    in ``dtype`` and quantized at once (``shiftjax.quantization``), so the peak is the FP8
    weights made so far plus one block array in ``dtype`` and its FP8 form.
    """
    make_blocks, make_replicated = _block_maker(mesh, param_shapes(config), seed, jnp.dtype(dtype))
    return assemble_weights(config, mesh, weight_storage, make_blocks, make_replicated, quantization)


def _canonical_cut_axes(config: ModelConfig) -> dict[str, int]:
    """The axis of each canonical tensor that the blocks cut (mesh-independent)."""
    plan = block_plan(config, head_layout(config.num_heads, config.num_kv_heads, 1, 1))
    return {segment.tensor: weight.cut_axis for weight in plan.values() for segment in weight.segments}


def dummy_params(config: ModelConfig, *, mesh: Mesh, dtype="bfloat16", seed: int = 0) -> Params:
    """The canonical form of :func:`dummy_weights`' model (to write a checkpoint of it).

    Each tensor is made sharded over all devices along the axis the blocks cut when its
    size divides evenly, else replicated (small tensors of odd sizes only).
    """
    shapes = param_shapes(config)
    make_blocks, make_replicated = _block_maker(mesh, shapes, seed, jnp.dtype(dtype))
    devices = mesh.devices.size
    flat = {}
    for name, cut_axis in _canonical_cut_axes(config).items():
        shape = shapes[name]
        pieces = devices if shape[cut_axis] % devices == 0 else 1
        spec = [None] * len(shape)
        if pieces > 1:
            spec[cut_axis] = HEAD_AXES
        whole = BlockWeight(name, "vocab", cut_axis, (Segment(name, blk.feature_index(shape[cut_axis], pieces)),))
        flat[name] = make_blocks(whole, shape, NamedSharding(mesh, P(*spec)), tuple(range(pieces)))
    for name in replicated_tensors(config):
        flat[name] = make_replicated(name, NamedSharding(mesh, P()))
    return params_from_flat(flat)


def write_checkpoint(params: Params, hf_config: dict, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Writes ``params`` (device arrays, any sharding) as a shiftjax checkpoint at ``out_dir``.

    ``hf_config`` is the Hugging Face ``config.json`` content. Orbax writes each array from
    the devices that hold it, with one chunk per shard, so a sharded restore that reads
    along the same axis touches little else. Nothing appears at ``out_dir`` until complete.
    """
    import orbax.checkpoint as ocp

    config = ModelConfig.from_hf_dict(hf_config)
    flat = params_to_flat(params)
    dtypes = {jnp.dtype(array.dtype).name for array in flat.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise CheckpointError(f"a checkpoint holds one dtype of {list(DTYPES)}, params have {sorted(dtypes)}")
    shapes = param_shapes(config)
    if {name: tuple(array.shape) for name, array in flat.items()} != shapes:
        raise CheckpointError("params do not have the shapes that hf_config implies")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; remove it or pass overwrite")
    staging = staging_dir_for(out_dir)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(staging / PARAMS_DIR, nest(flat))
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
        marker = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": dtypes.pop(),
                  "source": "dummy", "tensors": {name: list(shape) for name, shape in shapes.items()}}
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        publish(staging, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
