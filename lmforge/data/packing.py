"""Best-fit packing (data.packing = "best_fit"): whole documents placed into training sequences.

Concatenated packing (data.packing = "concat", lmforge.data.loader) cuts fixed windows from the token
stream, so most documents start in the middle of a window and are split over two. Here each row of
``C = seq_len + 1`` tokens (inputs and targets, as a window) holds whole documents:

* Documents are found by their end-of-document token (EOS ends, and belongs to, its document; tokens
  after the stream's last EOS are one more document): `document_spans`, a vectorised scan of each
  source once per process.
* A document longer than a row is split at sequence boundaries into pieces of C tokens that overlap by
  one (piece j starts at j * seq_len), so each of its tokens is a target exactly once, as in
  concatenated windows; the last piece is the remainder (2 .. C tokens): `split_long`.
* Each epoch of a source visits its documents in a seeded random order (``(seed, source, epoch)``);
  that order is cut into *buffers* of about ``packing_buffer`` rows' worth of tokens, and the pieces
  of one buffer are packed by best-fit decreasing (`best_fit_decreasing`: longest first, each into
  the open row with the least room that still fits it, else a new row). The buffer's rows are then
  shuffled (seeded by the buffer) so that long-document rows do not come in runs. A row's pieces are
  followed by padding up to C tokens; padding is EOS tokens, its targets are ignored (-100), and it
  comes after every real token of the row, so under the causal mask (and the document mask) no real
  token attends to it.

Determinism and resuming. Buffer b of epoch e depends only on (data, seq_len, packing_buffer, seed,
source, e, b), never on ranks or batch sizes. A source's packed rows are consumed in order: its k-th
sample is row k of the concatenation of its buffers' rows over the epochs (`BestFitRows.rows`), and
global samples go to data-parallel ranks as with concatenated windows (lmforge.data.loader), so the
rows of a global batch are the same at every world size. Random access to row k would need the row
counts of every earlier buffer, so a source keeps a *cursor* (epoch, buffer, rows before it): the
loader moves it, after each batch, to the buffer holding the next row the global stream needs, the
same on every rank, and saves it in its state: a resume (at any world size) packs only the cursor's
buffer and goes on bit-exactly. Cost: one buffer's best fit per ``packing_buffer`` rows (a Python
loop over its documents, O(d log d)), and one read per document piece (benchmarks/data_throughput.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from lmforge.data.shards import TokenShards
from lmforge.model.loss import IGNORE_INDEX

_SCAN_CHUNK = 1 << 24  # tokens per step of the EOS scan


def document_spans(shards: TokenShards, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) int64 arrays of the documents of `shards`' token stream, in order: each ends at
    an EOS token (included) or at the stream's end."""
    ends = [np.flatnonzero(chunk == eos_id) + offset
            for offset, chunk in _chunks(shards)]
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    ends = ends.astype(np.int64) + 1  # exclusive ends
    if not ends.size or ends[-1] != len(shards):
        ends = np.append(ends, len(shards))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return starts, ends - starts


def _chunks(shards: TokenShards):
    offset = 0
    for chunk in shards.iter_chunks(_SCAN_CHUNK):
        yield offset, chunk
        offset += len(chunk)


def split_long(starts: np.ndarray, lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of at most seq_len + 1 tokens: a document that fits is one piece; a longer one is cut
    into pieces starting every seq_len tokens (each overlapping the next by one token, so every token
    but the first is a target exactly once). Returns (piece start, piece length, document index)."""
    cap = seq_len + 1
    n = np.where(lengths <= cap, 1, -(-(lengths - 1) // seq_len))  # pieces per document
    doc = np.repeat(np.arange(len(lengths)), n)
    first = np.concatenate([[0], np.cumsum(n)[:-1]])
    j = np.arange(int(n.sum())) - np.repeat(first, n)  # piece index within its document
    piece_start = starts[doc] + j * seq_len
    piece_len = np.minimum(cap, lengths[doc] - j * seq_len)
    return piece_start, piece_len, doc


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of item indices: items in decreasing length (ties in index order), each into the open row
    with the least room left that still holds it, else into a new row. Hand-written (a sorted list of
    (room, row) searched with bisect): no library packs into bounded bins deterministically this way."""
    assert lengths.size == 0 or int(lengths.max()) <= capacity, (int(lengths.max()), capacity)
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row) of the rows with room, sorted
    for item in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[item])
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            left, row = room.pop(at)
        else:
            left, row = capacity, len(rows)
            rows.append([])
        rows[row].append(item)
        if left - n > 0:
            bisect.insort(room, (left - n, row))
    return rows


@dataclass
class Buffer:
    """One packed buffer of a source: its rows (lists of (start, length) pieces in the stream)."""

    epoch: int
    index: int  # buffer index within the epoch
    first_row: int  # the source's row index of this buffer's row 0
    rows: list[list[tuple[int, int]]]

    @property
    def end_row(self) -> int:
        return self.first_row + len(self.rows)


class BestFitRows:
    """The best-fit packed rows of one source, consumed in order (module docstring)."""

    def __init__(self, shards: TokenShards, seq_len: int, seed: int, source: int, buffer_rows: int, eos_id: int,
                 single_source: bool = True) -> None:
        if buffer_rows < 1:
            raise ValueError(f"data.packing_buffer = {buffer_rows} must be >= 1 (rows per best-fit buffer)")
        self.shards, self.seq_len, self.seed, self.source = shards, seq_len, int(seed), source
        self.eos_id, self.buffer_rows, self.single_source = int(eos_id), int(buffer_rows), single_source
        starts, lengths = document_spans(shards, eos_id)
        self.doc_starts, self.doc_lengths = starts, lengths
        self.piece_start, self.piece_len, self.piece_doc = split_long(starts, lengths, seq_len)
        first = np.concatenate([[0], np.cumsum(np.bincount(self.piece_doc, minlength=len(lengths)))])
        self._doc_pieces = first  # pieces of document d: [first[d], first[d + 1])
        self.tokens = int(lengths.sum())
        self._order: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # epoch -> (documents, buffer boundaries)
        self.buffer: Buffer | None = None
        self.position = (0, 0, 0)  # the cursor: (epoch, buffer, first row of that buffer)

    @property
    def documents(self) -> int:
        return len(self.doc_lengths)

    # ---- the epoch's order and buffers -----------------------------------------------------------------

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents in this epoch's order, buffer boundaries into that order)."""
        if epoch not in self._order:
            if len(self._order) >= 2:
                self._order.pop(min(self._order))
            rng_seed = (self.seed, epoch) if self.single_source else (self.seed, self.source, epoch)
            order = np.random.default_rng(rng_seed).permutation(self.documents)
            tokens = np.cumsum(self.doc_lengths[order])
            budget = self.buffer_rows * (self.seq_len + 1)
            cuts = np.searchsorted(tokens, np.arange(budget, int(tokens[-1]), budget), side="left") + 1
            bounds = np.unique(np.concatenate([[0], np.minimum(cuts, self.documents), [self.documents]]))
            self._order[epoch] = (order, bounds)
        return self._order[epoch]

    def _pack(self, epoch: int, index: int, first_row: int) -> Buffer:
        order, bounds = self._epoch(epoch)
        docs = order[bounds[index]:bounds[index + 1]]
        pieces = np.concatenate([np.arange(self._doc_pieces[d], self._doc_pieces[d + 1]) for d in docs])
        rows = [[(int(self.piece_start[pieces[i]]), int(self.piece_len[pieces[i]])) for i in row]
                for row in best_fit_decreasing(self.piece_len[pieces], self.seq_len + 1)]
        rng_seed = (self.seed, epoch, index) if self.single_source else (self.seed, self.source, epoch, index)
        shuffled = np.random.default_rng(rng_seed).permutation(len(rows))
        return Buffer(epoch, index, first_row, [rows[i] for i in shuffled])

    def _next(self, buf: Buffer) -> tuple[int, int]:
        _, bounds = self._epoch(buf.epoch)
        return (buf.epoch, buf.index + 1) if buf.index + 2 < len(bounds) else (buf.epoch + 1, 0)

    def _buffer_holding(self, row: int) -> Buffer:
        """The buffer that holds the source's row `row` (at or after the cursor), moving the cursor."""
        if self.buffer is None or (self.buffer.epoch, self.buffer.index, self.buffer.first_row) != self.position:
            self.buffer = self._pack(*self.position)
        if row < self.buffer.first_row:
            raise ValueError(f"best-fit packing: row {row} of source {self.source} lies before the loader's cursor "
                             f"(row {self.buffer.first_row}); the rows are consumed in order")
        while row >= self.buffer.end_row:
            epoch, index = self._next(self.buffer)
            self.buffer = self._pack(epoch, index, self.buffer.end_row)
            self.position = (epoch, index, self.buffer.first_row)
        return self.buffer

    def advance(self, row: int) -> None:
        """Move the cursor to the buffer holding `row`, the next row the global stream needs."""
        self._buffer_holding(row)

    # ---- rows ----------------------------------------------------------------------------------------

    def rows(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows k (increasing) as (tokens (n, seq_len + 1) int64 padded with EOS, real tokens per row)."""
        cap = self.seq_len + 1
        out = np.full((len(k), cap), self.eos_id, dtype=np.int64)
        fill = np.zeros(len(k), dtype=np.int64)
        for i, row in enumerate(np.asarray(k, dtype=np.int64).tolist()):
            buf = self._buffer_holding(row)
            at = 0
            for start, length in buf.rows[row - buf.first_row]:
                out[i, at:at + length] = self.shards.read(start, length)
                at += length
            fill[i] = at
        return out, fill

    def state(self) -> list[int]:
        return list(self.position)

    def load_state(self, position, seed: int | None = None) -> None:
        """Continue at a saved cursor (`state()`), with the checkpoint's seed where given."""
        if seed is not None and int(seed) != self.seed:
            self.seed, self._order = int(seed), {}
        epoch, index, first_row = (int(v) for v in position)
        if epoch < 0 or index < 0 or first_row < 0 or index + 1 >= len(self._epoch(epoch)[1]):
            raise ValueError(f"loader state: best-fit cursor {list(position)} of source {self.source} does not fit "
                             f"this data; the data, seq_len or data.packing_buffer changed since the checkpoint")
        self.position, self.buffer = (epoch, index, first_row), None


def padded_batch(rows: np.ndarray, fill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of packed rows: y = x shifted, with the targets that are padding ignored (-100)."""
    x, y = rows[:, :-1].copy(), rows[:, 1:].copy()
    y[np.arange(y.shape[1])[None, :] >= (fill[:, None] - 1)] = IGNORE_INDEX
    return x, y


def padding_fraction(fills: np.ndarray, seq_len: int) -> float:
    """Share of the rows' target positions that are padding (ignored): 1 - (fill - 1) / seq_len on average."""
    fills = np.asarray(fills, dtype=np.int64)
    return float((seq_len + 1 - fills).sum() / (len(fills) * seq_len)) if len(fills) else 0.0
