"""Weights to and from safetensors (no pickle: loading a file never executes code)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmforge.ckpt.streaming import safetensors_writer
from lmforge.config import Config, ModelConfig, load_config
from lmforge import folders
from lmforge.folders import CHECKPOINTS, CONFIG, EMA_WEIGHTS, WEIGHTS, atomic_path
from lmforge.model.layers import qkv_state
from lmforge.model.transformer import Transformer, build_model


# checkpoint.weights_dtype / `lmforge export --dtype`: the dtype written for floating-point tensors
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def written_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of `dtype` is written in when weights are asked for in `target` (None: as
    they are): floating-point tensors take `target`, others (integer buffers) keep theirs."""
    return target if target is not None and dtype.is_floating_point else dtype


def _unwrap_name(name: str) -> str:
    # activation-checkpoint / compile wrappers insert these prefixes into parameter names
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def model_state(model: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain state dict (of a module, or a given full state dict) with wrapper prefixes removed
    and tied weights stored once."""
    state, seen = {}, set()
    items = model.items() if isinstance(model, dict) else model.state_dict().items()
    for name, tensor in items:
        key = _unwrap_name(name)
        if tensor.untyped_storage().data_ptr() in seen and key == "lm_head.weight":
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        state[key] = tensor.detach().to("cpu").contiguous()
    return state


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Atomically write the model's weights as safetensors (temp file, fsync, rename)."""
    save_state(model, path)


def save_state(model: torch.nn.Module | dict[str, torch.Tensor], path: Path) -> None:
    """Atomically write a module's weights, or a full state dict, as safetensors."""
    with atomic_path(path) as tmp:
        save_file(model_state(model), str(tmp), metadata={"format": "lmforge"})


def save_streaming(path: Path, specs):
    """`with save_streaming(path, [(name, dtype, shape), ...]) as write:` lmforge's weights file written
    one tensor at a time (lmforge.ckpt.streaming), atomically."""
    return safetensors_writer(path, specs, metadata={"format": "lmforge"})


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a missing, truncated or corrupt file is a ValueError (see
    `check_safetensors`)."""
    return _checked_read(path, load_file)


def check_safetensors(path: str | Path) -> None:
    """ValueError naming the path and the fix when `path` is not a readable, complete safetensors file
    (safetensors itself says only "incomplete metadata", without the path); reads the header only."""
    from safetensors import safe_open

    def header(p: str) -> None:
        with safe_open(p, "pt"):
            pass

    _checked_read(path, header)


def _checked_read(path: str | Path, read):
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"weights file {str(path)!r} does not exist.")
    try:
        return read(str(path))
    except PermissionError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror}); check its permissions.") from None
    except (SafetensorError, OSError) as exc:
        reason = str(exc).removeprefix("Error while deserializing header: ")
        raise ValueError(
            f"{path} ({path.stat().st_size:,} bytes) is not a complete safetensors file ({reason}): it was "
            f"truncated (an interrupted copy or download, a full disk) or is corrupt. Fix: copy or write it "
            f"again from its source.") from None


def load_weights(model: Transformer, path: Path) -> None:
    """Copy the weights of a safetensors file (a run's model.safetensors) into `model`; ValueError
    names the file when it is missing, unreadable or does not match the model's config."""
    path = Path(path)
    state = qkv_state(model.cfg, read_safetensors(path))  # (either q/k/v layout, model.fused_qkv)
    if model.cfg.tie_embeddings and "tok_emb.weight" in state:
        state.setdefault("lm_head.weight", state["tok_emb.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}).")
    model.tie_weights()


def check_run_folder(run_dir: str | Path, checkpoint_ok: bool = False) -> Path:
    """`folders.check_run_folder`, a run that has not finished accepted (with `checkpoint_ok`) when
    it has a valid checkpoint."""
    return folders.check_run_folder(run_dir, has_checkpoint=(lambda d: newest_checkpoint(d) is not None)
                                    if checkpoint_ok else None)


def load_run(run_dir: str | Path, device: str | torch.device = "cpu", ema: bool = False) -> tuple[Config, Transformer]:
    """Load a finished run folder (config.toml + model.safetensors, or with `ema` the EMA of the weights,
    model.ema.safetensors) for evaluation or generation; a path that is not one is a one-line
    ValueError saying what it is (see `check_run_folder`)."""
    run_dir = check_run_folder(run_dir)
    cfg = load_config(str(run_dir / CONFIG))
    model = build_model(cfg.model, device)
    load_weights(model, ema_weights_file(run_dir) if ema else run_dir / WEIGHTS)
    model.eval()
    return cfg, model


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run folder that passes `verify_checkpoint`, or None."""
    from lmforge.ckpt.manager import list_checkpoints, verify_checkpoint

    for _, path in list_checkpoints(run_dir / CHECKPOINTS):
        try:
            verify_checkpoint(path)
            return path
        except ValueError:
            continue
    return None


class WeightReader:
    """A model's weights by (unwrapped) name, read one tensor at a time: from a module in memory, a
    safetensors file (memory-mapped) or a torch.distributed.checkpoint folder (each tensor gathered
    from every rank's shard files as it is read). `shapes` / `dtypes` are known without reading."""

    def __init__(self, shapes: dict[str, tuple], dtypes: dict[str, torch.dtype], read):
        self.shapes, self.dtypes, self.read = shapes, dtypes, read

    def in_dtype(self, target: torch.dtype | None) -> "WeightReader":
        """These weights with their floating-point tensors cast to `target` as they are read (None: as
        stored)."""
        if target is None:
            return self
        dtypes = {k: written_dtype(d, target) for k, d in self.dtypes.items()}
        return WeightReader(self.shapes, dtypes, lambda name: self.read(name).to(dtypes[name]))

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> "WeightReader":
        state = model_state(model)
        return cls({k: tuple(v.shape) for k, v in state.items()}, {k: v.dtype for k, v in state.items()},
                   state.__getitem__)

    @classmethod
    def of_file(cls, path: Path) -> "WeightReader":
        from safetensors import safe_open

        check_safetensors(path)
        with safe_open(str(path), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: getattr(torch, _DTYPES[f.get_slice(k).get_dtype()]) for k in f.keys()}

        def read(name: str) -> torch.Tensor:
            with safe_open(str(path), "pt") as f:
                return f.get_tensor(name)

        return cls(shapes, dtypes, read)

    @classmethod
    def of_checkpoint(cls, folder: Path, prefix: str = "model/weights/") -> "WeightReader":
        """The weights of a checkpoint (`prefix`: the model's; "ema/weights/": their EMA, train.ema_decay)."""
        import torch.distributed.checkpoint as dcp

        from lmforge.ckpt.safe_io import SafeFileSystemReader, safe_read_metadata

        md = {k[len(prefix):]: m for k, m in safe_read_metadata(folder).state_dict_metadata.items()
              if k.startswith(prefix)}

        def read(name: str) -> torch.Tensor:
            t = torch.empty(tuple(md[name].size), dtype=md[name].properties.dtype)
            dcp.load({prefix + name: t}, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
            return t

        return cls({k: tuple(m.size) for k, m in md.items()}, {k: m.properties.dtype for k, m in md.items()}, read)


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def run_weights(run_dir: str | Path, ema: bool = False) -> tuple[ModelConfig, WeightReader]:
    """A run folder's model config and its weights: model.safetensors, or for a run that has not
    finished its newest valid checkpoint (a sharded run's DCP shards, read tensor by tensor). With
    `ema`, the EMA of the weights (train.ema_decay): model.ema.safetensors, or the checkpoint's."""
    run_dir = check_run_folder(run_dir, checkpoint_ok=True)
    cfg = load_config(str(run_dir / CONFIG)).model
    if ema and not (run_dir / WEIGHTS).is_file():  # (a run that has not finished: its checkpoint's EMA)
        folder = newest_checkpoint(run_dir)
        return cfg, checkpoint_ema(folder, WeightReader.of_checkpoint(folder))
    if ema or (run_dir / WEIGHTS).is_file():
        return cfg, WeightReader.of_file(ema_weights_file(run_dir) if ema else run_dir / WEIGHTS)
    return cfg, WeightReader.of_checkpoint(newest_checkpoint(run_dir))


def ema_weights_file(run_dir: Path) -> Path:
    """A finished run's model.ema.safetensors; ValueError saying why a run has none."""
    path = Path(run_dir) / EMA_WEIGHTS
    if not path.is_file():
        raise ValueError(f"{run_dir} has no {EMA_WEIGHTS}: the run trained without train.ema_decay (or its EMA "
                         f"had not started by the end: train.ema_start_step). Train with --train.ema_decay 0.999.")
    return path


def checkpoint_ema(folder: Path, weights: WeightReader) -> WeightReader:
    """A checkpoint's EMA of the weights (train.ema_decay), its weights where the EMA has no tensor (frozen
    ones); ValueError when it holds no EMA."""
    ema = WeightReader.of_checkpoint(folder, "ema/weights/")
    if not ema.shapes:
        raise ValueError(f"{folder} holds no EMA of the weights (its run trained without train.ema_decay); drop --ema.")

    def read(name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in ema.shapes and "tok_emb.weight" in ema.shapes:
            name = "tok_emb.weight"  # (a tied head: one parameter, its EMA under the embedding's name)
        return ema.read(name).to(weights.dtypes[name]) if name in ema.shapes else weights.read(name)

    return WeightReader(weights.shapes, weights.dtypes, read)


def save_final_weights(layout, cfg: Config, path: Path, rank0: bool, decides) -> str | None:
    """The run's final safetensors weights, streamed by rank 0 one tensor at a time as `layout`
    (lmforge.parallel.layout.Layout) gathers them: LoRA adapters folded in unless
    finetune.merge_lora = false; a tied head stored once, as the embedding; floating-point tensors in
    checkpoint.weights_dtype. A collective: every rank calls this. Returns why the file could not be
    written (a full disk: the bytes free and needed), as `decides` (rank 0's value on every rank that
    calls it) gives it, or None; rank 0 then still drains the layout's gathers so that no rank is
    left in a collective."""
    import contextlib
    import math

    from lmforge.ckpt.manager import describe_write_error, free_bytes
    from lmforge.model.lora import is_adapter, merge_adapters

    ft = cfg.finetune
    merge = bool(ft.lora_rank and ft.merge_lora)
    target = WEIGHT_DTYPES[cfg.checkpoint.weights_dtype]
    specs = [(name, written_dtype(dtype, target), shape) for name, dtype, shape in layout.weight_specs()
             if not (merge and is_adapter(name))]
    adapters: dict[str, torch.Tensor] = {}
    needed = sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in specs)
    free = free_bytes(path.parent) if rank0 else None
    error: BaseException | None = None
    stack = contextlib.ExitStack()
    write = None
    if rank0:
        try:
            write = stack.enter_context(save_streaming(path, specs))
        except OSError as e:
            error = e
    for name, tensor in layout.full_weights():
        if write is None or error is not None:
            continue
        if merge and is_adapter(name):
            adapters[name] = tensor
            continue
        if merge:  # (its adapters came first: weight_specs' order)
            tensor = merge_adapters(name, tensor, adapters, ft.lora_rank, ft.lora_alpha, cfg.model)
        try:
            write(name, tensor.to(written_dtype(tensor.dtype, target)))
        except OSError as e:
            error = e
    try:
        if error is not None:  # (the writer removes its temp file; `path` stays as it was)
            stack.__exit__(type(error), error, error.__traceback__)
        else:
            stack.close()  # fsync, check, rename
    except OSError as e:
        error = error or e
    why = describe_write_error(error, path.parent, needed, free) if error is not None else None
    return decides(why)
