"""safetensors one tensor at a time: a writer that never holds more than the tensor it is given,
and reads of any part of a stored tensor.

The `safetensors` package writes a file from a dict of every tensor at once (`save_file`), which
for a 70B model is the whole model in memory. Its format is simple and fixed (an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then
the raw little-endian bytes back to back), so when every name, dtype and shape is known up front
the header can be written first and the tensors streamed after it, in header order. That is the
one thing hand-written here (no library offers it); the files are read back by `safetensors`
itself, and the writer checks the result through `safe_open` before it is published.

Reads go through `safetensors.safe_open(...).get_slice`, which memory-maps the file and copies only
the requested ranges: `read_part` takes the kept indices along each dim (as
`lmforge.model.materialise.local_index` gives them) and reads each contiguous run.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.folders import atomic_path

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code


@contextlib.contextmanager
def safetensors_writer(path: str | Path, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                       metadata: dict[str, str] | None = None) -> Iterator[Callable[[str, torch.Tensor], None]]:
    """Write a safetensors file tensor by tensor, atomically (lmforge.folders.atomic_path):

        with safetensors_writer(path, [(name, dtype, shape), ...], metadata) as write:
            for name, tensor in ...:        # in the order of the specs
                write(name, tensor)

    An exception inside the block (or a tensor left out) leaves `path` as it was."""
    specs = [(name, dtype, tuple(int(s) for s in shape)) for name, dtype, shape in specs]
    assert len({name for name, _, _ in specs}) == len(specs), "duplicate tensor names"
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in specs:
        size = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # (safetensors aligns the data to 8 bytes)
    done = [0]
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(blob)) + blob)

            def write(name: str, tensor: torch.Tensor) -> None:
                want, dtype, shape = specs[done[0]]
                if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                    raise AssertionError(f"writer expected {want} {dtype} {shape}, got {name} {tensor.dtype} "
                                         f"{tuple(tensor.shape)}")
                data = tensor.detach().to("cpu").contiguous().reshape(-1)
                if data.numel():
                    fh.write(data.view(torch.uint8).numpy().data)
                done[0] += 1

            yield write
        if done[0] != len(specs):
            raise AssertionError(f"writer: {len(specs) - done[0]} tensors were not written (next: {specs[done[0]][0]})")
        _check(tmp, specs)


def _check(path: Path, specs) -> None:
    """The written file opens with safetensors and lists exactly the specs."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        assert names == {name for name, _, _ in specs}, (sorted(names)[:5], len(specs))


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted unique indices -> [(start, stop)) runs of consecutive ones."""
    values = index.tolist()
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs


def read_part(part, shape: Sequence[int], index: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The sub-tensor of a safetensors slice (`safe_open(...).get_slice(name)`) of full `shape` at
    `index` (per dim: sorted kept indices, None for all), reading only those bytes."""
    per_dim = []
    for d, size in enumerate(shape):
        idx = index[d] if d < len(index) else None
        if idx is None:
            per_dim.append([(0, size)])
        else:
            assert bool((idx[1:] > idx[:-1]).all()), "indices must be sorted and unique"
            per_dim.append(_runs(idx))
    if not shape:
        return part[()]

    def read(d: int, prefix: tuple) -> torch.Tensor:
        if d == len(shape):
            return part[prefix]
        pieces = [read(d + 1, prefix + (slice(a, b),)) for a, b in per_dim[d]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)

    return read(0, ())


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor of a model lies in a checkpoint file: the stored tensor `key`, or a part of it
    starting at `offset` along each stored dim (a fused tensor, e.g. GPT-2's c_attn), stored
    transposed when `transpose` (GPT-2's Conv1D weights). A safetensors `file` is read slice by
    slice; `tensors` (a memory-mapped `torch.load(..., mmap=True)` of a pytorch_model.bin) instead
    is indexed in place."""

    file: Path
    key: str
    transpose: bool = False
    offset: tuple[int, ...] = ()
    tensors: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def read(self, shape: Sequence[int], index: Sequence[torch.Tensor | None], name: str = "") -> torch.Tensor:
        """The part at `index` (per dim of the tensor as the model holds it: kept indices, None all)
        of the tensor of `shape`, reading only those bytes; ValueError names the file and the key
        when the stored tensor is missing or has another shape (and `name`, the model's own name)."""
        shape = tuple(shape)
        index = list(index) + [None] * (len(shape) - len(index))
        if self.transpose:
            assert len(shape) == 2, (self.key, shape)
            shape, index = shape[::-1], index[::-1]
        with self._stored() as part:
            stored = tuple(part.shape if isinstance(part, torch.Tensor) else part.get_shape())
            offset = self.offset or (0,) * len(shape)
            need = tuple(n + o for n, o in zip(shape, offset))
            if len(stored) != len(shape) or any(s < n for s, n in zip(stored, need)) or \
                    (not self.offset and stored != shape):
                want = need if self.offset else shape
                ours = f" (lmforge's {name})" if name and name != self.key else ""
                raise ValueError(f"{self.file}: {self.key}{ours} has shape {stored}, the model config implies "
                                 f"{tuple(want[::-1]) if self.transpose else want}.")
            stored_index = [None if i is None and o == 0 and s == n else (torch.arange(n) if i is None else i) + o
                            for i, n, o, s in zip(index, shape, offset, stored)]
            out = read_part(part, stored, stored_index)
        return out.t() if self.transpose else out

    @contextlib.contextmanager
    def _stored(self):
        if self.tensors is not None:
            if self.key not in self.tensors:
                raise ValueError(f"{self.file}: no tensor {self.key!r}; the weights do not match the model config.")
            yield self.tensors[self.key]
            return
        from safetensors import safe_open

        with safe_open(str(self.file), "pt") as f:
            if self.key not in f.keys():
                raise ValueError(f"{self.file}: no tensor {self.key!r}; the weights do not match the model config.")
            yield f.get_slice(self.key)
