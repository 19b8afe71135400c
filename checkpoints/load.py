"""Restoring a shiftjax checkpoint onto devices, straight into the wanted shardings.

Two ways in:

- :func:`load_checkpoint` restores the canonical ``Params`` with Orbax, each tensor in a
  sharding the caller gives (``shard_params`` then expands them into blocks).
- :func:`restore_weights` (and :func:`load_weights`, which also makes random weights)
  builds the block layout directly: every device reads from the checkpoint only the
  canonical rows its blocks hold and receives exactly its final shards. Device memory
  never holds a canonical tensor, so the peak is the final weights; host memory holds one
  device's block of one tensor at a time.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from shiftjax.checkpoints.format import CONFIG_FILE, PARAMS_DIR, CheckpointError, nest, read_marker, unnest
from shiftjax.config import ConfigError, ModelConfig
from shiftjax.params import Params, param_shapes, params_from_flat
from shiftjax.weights import BlockWeight, ModelWeights, assemble_weights


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a complete checkpoint."""
    path = Path(path)
    read_marker(path)
    try:
        return ModelConfig.from_json_file(path / CONFIG_FILE)
    except ConfigError as error:
        raise CheckpointError(f"{path / CONFIG_FILE}: {error}") from None


def _checked_shapes(path: Path, info: dict, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = param_shapes(config)
    stored = info.get("tensors", {})
    for name, shape in shapes.items():
        if name in stored and tuple(stored[name]) != shape:
            raise CheckpointError(
                f"{path / 'shiftjax.json'} records {name} as {stored[name]}, but config.json "
                f"implies {list(shape)}; the checkpoint is inconsistent, convert it again"
            )
    return shapes


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
    shapes = _checked_shapes(path, info, config)
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


CHUNK_CACHE_BYTES = 8 << 30


class CanonicalReader:
    """Reads slices of the canonical tensors of a checkpoint's Orbax ``params/`` directory.

    Orbax restores whole shards of one tensor per device; a block of the layout is made of
    slices of several tensors (``q | k | v``), padding and, under GQA, KV heads that several
    devices share. So the tensors are opened through TensorStore with the specs Orbax itself
    reads them with, and sliced along the axis the blocks cut. Values are cast on the host
    with ``astype`` as Orbax does, so the result is bit-identical to an Orbax restore.
    """

    def __init__(self, params_dir: Path, shapes: dict[str, tuple[int, ...]], dtype):
        import orbax.checkpoint as ocp
        import tensorstore as ts

        self.params_dir = Path(params_dir)
        self.shapes = shapes
        self.dtype = np.dtype(dtype)
        # A chunk cache as large as the largest tensor: a converted checkpoint stores each
        # tensor as one chunk, and every block of a tensor reads from it in turn (blocks are
        # made tensor by tensor), so it is decoded once instead of once per block. Capped,
        # because it is host memory: past the cap (a 70B tensor) each block decodes anew.
        largest = max(int(np.prod(shape)) for shape in shapes.values()) * 4
        self.context = ts.Context({"cache_pool": {"total_bytes_limit": min(largest, CHUNK_CACHE_BYTES)}},
                                  parent=ocp.type_handlers.get_ts_context(use_ocdbt=True))
        self.bytes_read: dict[str, int] = defaultdict(int)  # host bytes per tensor, for tests
        self._opened = {}
        self._lock = threading.Lock()  # blocks are read from several threads

    def _open(self, name: str):
        import orbax.checkpoint as ocp
        import tensorstore as ts

        with self._lock:
            if name in self._opened:
                return self._opened[name]
        errors = []
        for use_zarr3 in (False, True):  # Orbax has written both, depending on its version
            info = ocp.type_handlers.ParamInfo(name=name, parent_dir=self.params_dir, is_ocdbt_checkpoint=True,
                                               use_zarr3=use_zarr3, ts_context=self.context)
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
            try:
                store = ts.open(spec, open=True, context=self.context).result()
                break
            except ValueError as error:
                errors.append(str(error))
        else:
            raise CheckpointError(f"cannot open {name} in {self.params_dir}: {'; '.join(errors)}")
        if tuple(store.shape) != self.shapes[name]:
            raise CheckpointError(
                f"{self.params_dir} stores {name} as {list(store.shape)}, but config.json implies "
                f"{list(self.shapes[name])}; convert the checkpoint again"
            )
        with self._lock:
            return self._opened.setdefault(name, store)

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``tensor[..., start:stop, ...]`` along ``axis`` (the whole tensor when None), cast."""
        store = self._open(name)
        index = [slice(None)] * len(self.shapes[name])
        if axis is not None:
            index[axis] = slice(start, stop)
        data = store[tuple(index)].read().result()
        with self._lock:
            self.bytes_read[name] += data.nbytes
        return data.astype(self.dtype, copy=False)

    def block(self, weight: BlockWeight, block: int) -> np.ndarray:
        """Block ``block`` of ``weight``, read slice by slice; padding positions are zero."""
        pieces = []
        for segment in weight.segments:
            rows = segment.index[block]
            valid = rows >= 0
            shape = list(self.shapes[segment.tensor])
            shape[weight.cut_axis] = len(rows)
            if not valid.any():  # a block of padding only (more blocks than heads)
                pieces.append(np.zeros(shape, self.dtype))
                continue
            # One contiguous read per segment: a block's heads or features are a contiguous
            # run of the canonical tensor (layouts/heads.py), so little is read twice.
            first, last = int(rows[valid].min()), int(rows[valid].max()) + 1
            data = self.read(segment.tensor, weight.cut_axis, first, last)
            piece = np.take(data, np.where(valid, rows - first, 0), axis=weight.cut_axis)
            padding = [slice(None)] * piece.ndim
            padding[weight.cut_axis] = ~valid
            piece[tuple(padding)] = 0
            pieces.append(piece)
        return np.concatenate(pieces, axis=weight.cut_axis)


# Blocks read at once: each read decodes its chunks on TensorStore's threads, but one chunk
# per read (a sharded checkpoint's shard) decodes on one thread, so blocks are read side by
# side. Bounded, because host memory holds every block in flight.
BLOCKS_IN_FLIGHT = 4


def _block_maker(reader: CanonicalReader):
    import jax

    def make_blocks(weight: BlockWeight, shape, sharding, blocks_at):
        axis = weight.block_axis
        per_position = sharding.shard_shape(shape)[axis]
        index_map = sharding.addressable_devices_indices_map(shape)
        devices_of_block = defaultdict(list)
        for device, index in index_map.items():
            devices_of_block[blocks_at[(index[axis].start or 0) // per_position]].append(device)
        shards = {}
        with ThreadPoolExecutor(BLOCKS_IN_FLIGHT) as pool:
            pending = list(devices_of_block)
            in_flight = {}
            while pending or in_flight:
                while pending and len(in_flight) < BLOCKS_IN_FLIGHT:
                    block = pending.pop(0)
                    in_flight[pool.submit(reader.block, weight, block)] = block
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    data = future.result()
                    if weight.stacked:
                        data = data[:, None]
                    for device in devices_of_block[in_flight.pop(future)]:
                        shards[device] = jax.device_put(data, device)
        return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in index_map])

    def make_replicated(name: str, sharding):
        return jax.device_put(reader.read(name), sharding)

    return make_blocks, make_replicated


def restore_weights(path: str | Path, *, mesh, dtype=None, weight_storage: str = "aliased",
                    reader: CanonicalReader | None = None,
                    quantization: str | None = None) -> tuple[ModelConfig, ModelWeights]:
    """Restores a checkpoint straight into the block layout of ``mesh`` (sharded restore).

    Equal, bit for bit, to ``shard_params(load_checkpoint(path, dtype=dtype, shardings=
    replicated)[1], config, mesh, weight_storage, quantization)`` (with ``quantization`` as
    resolved below), without ever holding a canonical tensor
    on a device. ``dtype`` None keeps the stored dtype. ``reader`` is for tests that count
    what is read. ``quantization``: ``"fp8"`` quantizes the layer GEMM weights as they load
    (``shiftjax.quantization``); None: as the checkpoint says (``fp8`` for one converted from
    an FP8 checkpoint, :func:`checkpoint_quantization`), else ``"none"``.
    """
    import jax.numpy as jnp

    path = Path(path).absolute()
    info = read_marker(path)
    if quantization is None:
        quantization = checkpoint_quantization(info)
        if quantization != "none" and weight_storage != "aliased":
            raise CheckpointError(f"{path} was converted from an {quantization} checkpoint and is served "
                                  f"{quantization}, which needs --weight-storage aliased; or serve it in its "
                                  f"dtype with --quantization none")
    config = load_config(path)
    shapes = _checked_shapes(path, info, config)
    target_dtype = jnp.dtype(dtype if dtype is not None else info.get("dtype", "float32"))
    if reader is None:
        reader = CanonicalReader(path / PARAMS_DIR, shapes, target_dtype)
    make_blocks, make_replicated = _block_maker(reader)
    return config, assemble_weights(config, mesh, weight_storage, make_blocks, make_replicated, quantization)


def checkpoint_quantization(info: dict) -> str:
    """The quantization a checkpoint's ``shiftjax.json`` asks to be served with: ``fp8`` for
    one converted from an FP8 checkpoint (``convert``'s ``quantization`` record), else ``none``."""
    record = info.get("quantization")
    return record.get("method", "none") if isinstance(record, dict) else "none"


LOAD_FORMATS = ("orbax", "dummy")


def load_weights(model: str | Path, *, mesh, dtype="bfloat16", weight_storage: str = "aliased",
                 load_format: str = "orbax", seed: int = 0,
                 quantization: str | None = None) -> tuple[ModelConfig, ModelWeights]:
    """The model's weights on ``mesh`` in their final block layout, never a canonical copy.

    ``load_format="orbax"``: ``model`` is a shiftjax checkpoint directory (or ``"default"``
    for the embedded SmolLM2); each device reads only what its blocks hold.
    ``load_format="dummy"``: ``model`` is a Hugging Face ``config.json`` (or a directory
    holding one; a shiftjax checkpoint directory works too); random weights (seed ``seed``)
    are generated on the devices in their final shardings. ``dtype``: e.g. "bfloat16",
    "float32"; for orbax, None keeps the stored dtype. ``quantization``: ``"none"``,
    ``"fp8"`` (the layer GEMM weights quantized as they load), or None: as the checkpoint
    says (dummy weights: ``"none"``).
    """
    if load_format == "dummy":
        from shiftjax.checkpoints.dummy import dummy_weights, read_model_config

        config = read_model_config(model)
        return config, dummy_weights(config, mesh=mesh, dtype=dtype or "bfloat16",
                                     weight_storage=weight_storage, seed=seed, quantization=quantization or "none")
    if load_format != "orbax":
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    return restore_weights(_checkpoint_path(model), mesh=mesh, dtype=dtype, weight_storage=weight_storage,
                           quantization=quantization)


def _checkpoint_path(model: str | Path) -> Path:
    if str(model) == "default":
        from shiftjax.checkpoints.default_model import default_model_path

        return default_model_path()
    return Path(model)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (see ``shiftjax.checkpoints.tokenizer.Tokenizer``)."""
    from shiftjax.checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def tokenizer_path_for(model: str | Path, load_format: str = "orbax", tokenizer: str | Path | None = None) -> Path:
    """Where the tokenizer of ``model`` lives: ``tokenizer`` when given (a directory with
    ``tokenizer.json``), else the checkpoint itself, else (dummy weights have none) the
    default model's checkpoint, prepared on first use."""
    if tokenizer is not None:
        return Path(tokenizer)
    if load_format == "orbax":
        return _checkpoint_path(model)
    from shiftjax.checkpoints.default_model import default_model_path

    return default_model_path()
