"""Reading torch.distributed.checkpoint folders without trusting them.

DCP's FileSystemReader unpickles the `.metadata` file with plain `pickle.load`, so a crafted
checkpoint could run code on load. `SafeFileSystemReader` unpickles it with an allow-list of the
handful of metadata classes DCP writes (no functions but torch's own layout lookup), then checks
that every storage record points at a file inside the checkpoint folder and that the checkpoint
holds tensors only (non-tensor DCP items are unpickled with `weights_only=False` by torch, so
lmforge never writes them and refuses to read them). Tensor payloads are raw bytes.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
}


class CheckpointSecurityError(ValueError):
    """The checkpoint contains something lmforge will not load (code, or paths leaving its folder)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointSecurityError(
            f"checkpoint metadata references {module}.{name}, which is not a DCP metadata class; "
            f"refusing to load it (a checkpoint must never execute code).")


def safe_read_metadata(path: str | Path) -> Metadata:
    """DCP metadata of a checkpoint folder, unpickled with the allow-list and path-checked."""
    folder = Path(path)
    meta_file = folder / ".metadata"
    if not meta_file.is_file():
        raise ValueError(f"{folder}: not a torch.distributed.checkpoint folder (no .metadata file)")
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(meta_file.read_bytes())).load()
    except CheckpointSecurityError:
        raise
    except Exception as e:  # truncated / garbage file
        raise ValueError(f"{meta_file}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointSecurityError(f"{meta_file}: holds a {type(metadata).__name__}, not DCP Metadata")
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointSecurityError(
                f"{folder}: entry {key!r} is a pickled object, not a tensor; lmforge checkpoints hold tensors "
                f"only and never unpickle objects.")
    for info in (metadata.storage_data or {}).values():
        check_relative(folder, str(info.relative_path))
    return metadata


def check_relative(folder: Path, name: str) -> Path:
    """`folder / name`, refusing absolute names and names that climb out of the folder."""
    rel = PurePosixPath(name.replace("\\", "/"))
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointSecurityError(f"{folder}: file name {name!r} escapes the checkpoint folder")
    full = (folder / rel).resolve()
    if folder.resolve() not in full.parents:
        raise CheckpointSecurityError(f"{folder}: file name {name!r} escapes the checkpoint folder")
    return full


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `safe_read_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = safe_read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
