"""Packed, shuffled, rank-sharded batches of fixed-length windows over token shards.

Each token stream (one :class:`TokenShards`, or each source of a :class:`TokenMixture`) is cut
into ``n = (len - 1) // seq_len`` non-overlapping windows of ``seq_len + 1`` tokens (window i
starts at ``i * seq_len``; consecutive windows share one boundary token so every token is a
target exactly once). Samples form one endless *global* stream that does not depend on the
number of ranks:

* one stream: global sample ``g`` is window ``perm_e[g % n]`` with ``e = g // n`` and
  ``perm_e = default_rng((seed, e)).permutation(n)``;
* a mixture of S sources with weights w_s: the global stream is cut into blocks of
  ``MIX_BLOCK`` samples; every block holds ``c_s`` samples of source s (``w_s * MIX_BLOCK``
  rounded by largest remainder, at least 1), spread evenly through the block in a fixed order.
  The k-th sample of source s is window ``perm_{s,e}[k % n_s]``, ``e = k // n_s``, with
  ``perm_{s,e} = default_rng((seed, s, e)).permutation(n_s)``. So every prefix of the stream
  has the weighted proportions to within one block rounding (|realised - w_s| <= 1/MIX_BLOCK
  plus the partial last block), and each source goes through its own epochs: a small source
  is repeated (up-sampled), a large one only partly seen (sub-sampled) in the same time.

Each step consumes the next ``batch_size * world_size`` global samples; rank r takes every
``world_size``-th of them starting at r. So ranks are disjoint, their union is the global
stream, and the state is the global position only: resuming with another world size (and/or
another per-rank batch) continues the same global sample stream at exactly the next sample;
with the same global batch the global batches themselves are identical.

Mixture stages (data.stages; lmforge.data.mixture): the weights may change at given global samples;
each source keeps its own sample count k across the stages, so the windows above are unchanged, only
which source a global sample draws from follows the stage. A checkpoint records the stages that have
begun; a resume refuses a config that changes them and accepts stages that begin later.

``packing="best_fit"`` (lmforge.data.packing): the k-th sample of a source is its k-th row of whole
documents packed by best-fit decreasing, padded with EOS (padding targets -100) instead of window
``perm[k % n]``; the mapping of global samples to sources and ranks is the same.

``mask_doc_boundaries=True`` sets a target to -100 (ignored by the loss) where the input
token is EOS, i.e. where the model would be asked to predict the first token of an unrelated
next document from the previous one. x/y shapes are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from lmforge.data.mixture import MIX_BLOCK, MixStage, MixtureStream, mixture_block, mixture_entries, stage_record
from lmforge.data.packing import BestFitRows, padded_batch
from lmforge.data.shards import TokenShards
from lmforge.folders import MANIFEST, MIXTURE
from lmforge.model.loss import IGNORE_INDEX

log = logging.getLogger("lmforge.data")

PACKINGS = ("concat", "best_fit")
_mixture_block = mixture_block  # (the name earlier versions exported)


class TokenMixture:
    """Several token-shard sets with mixture weights (normalised to sum to 1)."""

    def __init__(self, sources: Sequence[tuple[str, TokenShards, float]],
                 dir: Path | None = None) -> None:
        if not sources:
            raise ValueError("a token mixture needs at least one source")
        names = [n for n, _, _ in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture source names must be unique: {names}")
        for n, _, w in sources:
            if not w > 0:
                raise ValueError(f"mixture source {n!r}: weight {w} must be > 0")
        vocab = {sh.vocab_size for _, sh, _ in sources}
        if len(vocab) != 1:
            raise ValueError(f"mixture sources have different vocab sizes {sorted(vocab)}: "
                             f"they were prepared with different tokenizers")
        total = sum(w for _, _, w in sources)
        self.names = names
        self.shards = [sh for _, sh, _ in sources]
        self.weights = [w / total for _, _, w in sources]
        self.dir = Path(dir) if dir is not None else self.shards[0].dir.parent
        self.manifest = self.shards[0].manifest

    @classmethod
    def open(cls, dir: Path, weights: dict[str, float] | None = None,
             verify_checksums: str | bool = "never") -> "TokenMixture":
        """Open ``dir/mixture.json`` (written by ``lmforge prepare``); ``weights`` override."""
        dir = Path(dir)
        entries = mixture_entries(dir)
        if weights:
            unknown = set(weights) - {n for n, _, _ in entries}
            if unknown:
                raise ValueError(f"mixture weights name unknown sources {sorted(unknown)}; "
                                 f"known: {[n for n, _, _ in entries]}")
            entries = [(n, d, float(weights.get(n, w))) for n, d, w in entries]
        return cls([(n, TokenShards(dir / d, verify_checksums), w) for n, d, w in entries],
                   dir=dir)

    @property
    def vocab_size(self) -> int:
        return self.shards[0].vocab_size

    @property
    def max_id(self) -> int:
        """Largest token id over all sources (see :attr:`TokenShards.max_id`)."""
        return max(s.max_id for s in self.shards)

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:.3f}" for n, w in zip(self.names, self.weights))
        return f"TokenMixture({str(self.dir)!r}, {parts})"


def open_tokens(dir: Path, verify_checksums: str | bool = "never") -> TokenShards | TokenMixture:
    """A shard directory (``manifest.json``) or a prepared train mixture (``mixture.json``)."""
    dir = Path(dir)
    if (dir / MANIFEST).is_file() or not (dir / MIXTURE).is_file():
        return TokenShards(dir, verify_checksums)
    return TokenMixture.open(dir, verify_checksums=verify_checksums)


class PackedLoader:
    """Batches ``(x, y)`` of int64 tensors of shape ``(batch_size, seq_len)``, ``y = x`` shifted."""

    def __init__(self, shards: TokenShards | TokenMixture, seq_len: int, batch_size: int,
                 seed: int, rank: int = 0, world_size: int = 1,
                 mask_doc_boundaries: bool = False, eos_id: int | None = None, packing: str = "concat",
                 packing_buffer: int = 256, stages: Sequence[MixStage] | None = None) -> None:
        """`stages` (lmforge.data.mixture; None: one stage of the mixture's weights); `packing` "concat"
        (windows) or "best_fit" (whole documents in rows of `packing_buffer`-row buffers)."""
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if packing not in PACKINGS:
            raise ValueError(f"packing = {packing!r} is not one of {PACKINGS}")
        if isinstance(shards, TokenMixture):
            streams, weights = shards.shards, shards.weights
        else:
            streams, weights = [shards], [1.0]
        counts = []
        for st in streams:
            n = (len(st) - 1) // seq_len
            if n < 1:
                raise ValueError(
                    f"{st.dir} has {len(st)} tokens, fewer than seq_len+1={seq_len + 1}; "
                    f"use a smaller seq_len or more data (for val: a larger val_fraction)")
            counts.append(n)
        self.shards = shards
        self.streams = streams
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.windows_per_source = counts
        self.num_windows = int(sum(counts))
        self.position = 0  # global samples consumed (all ranks)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.names = list(getattr(shards, "names", None) or [""])
        if stages is None:
            stages = [MixStage(0, tuple(weights), "stage 0", stage_record(0, self.names, weights))]
        self.mixture = MixtureStream(stages, len(streams))
        self.mask_doc_boundaries = bool(mask_doc_boundaries)
        self.packing, self.packing_buffer = packing, int(packing_buffer)
        self.eos_id = eos_id
        if (self.mask_doc_boundaries or packing == "best_fit") and eos_id is None:
            self.eos_id = streams[0].manifest.get("meta", {}).get("eos_id")
            if self.eos_id is None:
                what = "mask_doc_boundaries" if self.mask_doc_boundaries else "best-fit packing"
                raise ValueError(f"{what} needs eos_id: {streams[0].dir} has no "
                                 f"meta.eos_id in its manifest; pass eos_id=")
        self.packers = [BestFitRows(st, seq_len, self.seed, s, packing_buffer, self.eos_id, len(streams) == 1)
                        for s, st in enumerate(streams)] if packing == "best_fit" else []

    @property
    def epoch(self) -> int:
        """Epoch of the next global sample (for a mixture: in units of all windows)."""
        return self.position // self.num_windows

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            mine = [k for k in self._perms if k[0] == source]
            if len(mine) >= 2:
                self._perms.pop(min(mine))
            n = self.windows_per_source[source]
            rng_seed = (self.seed, epoch) if len(self.streams) == 1 else \
                (self.seed, source, epoch)
            self._perms[key] = np.random.default_rng(rng_seed).permutation(n)
        return self._perms[key]

    def sources_and_windows(self, global_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window index) of the given global sample indices (concatenated packing)."""
        src, k = self.mixture.locate(global_idx)
        n = np.asarray(self.windows_per_source, dtype=np.int64)[src]
        epochs, pos = np.divmod(k, n)
        out = np.empty_like(global_idx)
        for s in np.unique(src):
            for e in np.unique(epochs[src == s]):
                sel = (src == s) & (epochs == e)
                out[sel] = self._perm(int(s), int(e))[pos[sel]]
        return src, out

    def _windows(self, global_idx: np.ndarray) -> np.ndarray:
        """Window indices of the given global sample indices (single-stream data)."""
        return self.sources_and_windows(global_idx)[1]

    def _batch(self, windows: np.ndarray, sources: np.ndarray | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if sources is None:
            sources = np.zeros_like(windows)
        rows = np.empty((windows.size, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(sources):
            sel = sources == s
            rows[sel] = self.streams[int(s)].gather(windows[sel] * self.seq_len,
                                                    self.seq_len + 1)
        rows_t = torch.from_numpy(rows)
        # (.clone(): for one-row batches .contiguous() returns views of the same storage, and masking
        # y would write -100 into x)
        x, y = rows_t[:, :-1].clone(), rows_t[:, 1:].clone()
        if self.mask_doc_boundaries:
            y[x == self.eos_id] = IGNORE_INDEX
        return x, y

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next batch; advances the global position by batch_size * world_size."""
        g = self.position + self.rank + self.world_size * np.arange(self.batch_size,
                                                                    dtype=np.int64)
        self.position += self.batch_size * self.world_size
        if self.packing == "concat":
            src, win = self.sources_and_windows(g)
            return self._batch(win, src)
        return self._packed_batch(*self.mixture.locate(g))

    def _packed_batch(self, sources: np.ndarray, k: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Best-fit rows k of `sources`; then every source's cursor moves to the row the global stream
        needs next (the same on every rank: the state a checkpoint saves)."""
        rows = np.empty((len(k), self.seq_len + 1), dtype=np.int64)
        fill = np.empty(len(k), dtype=np.int64)
        for s in np.unique(sources).tolist():
            sel = sources == s
            rows[sel], fill[sel] = self.packers[s].rows(k[sel])
        for packer, nxt in zip(self.packers, self.mixture.counts_before(self.position).tolist()):
            packer.advance(nxt)
        x, y = (torch.from_numpy(t) for t in padded_batch(rows, fill))
        if self.mask_doc_boundaries:
            y[x == self.eos_id] = IGNORE_INDEX
        return x, y

    def _fingerprint(self) -> list:
        return [[n, int(c)] for n, c in zip(self.names, self.windows_per_source)]

    def state_dict(self) -> dict:
        sd = {"epoch": self.epoch, "position": self.position, "seed": self.seed}
        if len(self.streams) > 1:
            sd["mixture"] = self._fingerprint()
        if len(self.streams) > 1 or len(self.mixture.stages) > 1:
            sd["stages"] = self.mixture.begun(self.position)
        if self.packers:
            sd["packing"] = {"buffer": self.packing_buffer, "cursors": [p.state() for p in self.packers]}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Resume so that the next batch is the one that followed ``sd``'s last batch.

        Works for any rank / world_size (the state is the global position).
        """
        try:
            position, seed, epoch = int(sd["position"]), int(sd["seed"]), int(sd["epoch"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"loader state {sd!r} needs integer 'position', 'seed', "
                             f"'epoch' ({e})") from e
        if position < 0:
            raise ValueError(f"loader state position={position} must be >= 0")
        if epoch != position // self.num_windows:
            raise ValueError(
                f"loader state epoch={epoch} at position={position} does not match this "
                f"dataset ({self.num_windows} windows of seq_len={self.seq_len}): the data "
                f"or seq_len changed since the checkpoint")
        saved_stages = sd.get("stages")
        if len(self.streams) > 1 or "mixture" in sd:
            saved = sd.get("mixture") or []
            if saved and all(isinstance(e, list) and len(e) == 3 for e in saved):  # (before stages: weights here)
                saved_stages = saved_stages or ([stage_record(0, [e[0] for e in saved], [e[2] for e in saved])]
                                                if position else [])
                saved = [e[:2] for e in saved]
            if saved != self._fingerprint():
                raise ValueError(
                    f"loader state mixture {sd.get('mixture')} does not match this data "
                    f"{self._fingerprint()} ([name, windows] per source): the "
                    f"sources or seq_len changed since the checkpoint")
        if saved_stages is None and len(self.streams) == 1:  # (one source, one stage: nothing recorded)
            saved_stages = self.mixture.begun(position)[:1]
        self._check_stages(saved_stages or [], position)
        self._check_packing(sd.get("packing"))
        if seed != self.seed:
            log.warning("data: resuming loader with checkpoint seed %d (config says %d)",
                        seed, self.seed)
        self.seed, self.position = seed, position
        self._perms.clear()
        for packer, cursor in zip(self.packers, (sd.get("packing") or {}).get("cursors", [])):
            packer.load_state(cursor, seed)

    def _check_stages(self, saved: list[dict], position: int) -> None:
        """The stages that had begun at the checkpoint are this config's, unchanged; a stage of this
        config that begins before the checkpoint's position is one the checkpoint never ran."""
        mine = self.mixture.begun(position)
        if saved == mine:
            return
        for i in range(max(len(saved), len(mine))):
            old = saved[i] if i < len(saved) else None
            new = mine[i] if i < len(mine) else None
            if old != new:
                break
        raise ValueError(
            f"data.stages: the checkpoint was saved at global sample {position:,} with the stages that had begun "
            f"then {saved}, but this config's stages up to that point are {mine}: stage {i} "
            f"({'changed' if old and new else 'added before the checkpoint' if new else 'removed'}; checkpoint "
            f"{old}, config {new}). A stage that has run cannot change (its data were trained on); keep it as it "
            f"was and add a new stage with a start_step after the checkpoint's step.")

    def _check_packing(self, saved: dict | None) -> None:
        if (saved is None) != (not self.packers) or (saved and saved.get("buffer") != self.packing_buffer) or (
                saved and len(saved.get("cursors", [])) != len(self.packers)):
            then = f"best_fit with packing_buffer {saved.get('buffer')}" if saved else "concat"
            now = f"best_fit with packing_buffer {self.packing_buffer}" if self.packers else "concat"
            raise ValueError(f"data.packing: the checkpoint's loader packed {then}, this config packs {now}; the "
                             f"sequences it trained on would not continue. Resume with the checkpoint's data.packing "
                             f"and data.packing_buffer, or start a fresh run.")

    def iter_eval_batches(self, max_batches: int | None = None
                          ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Sequential (unshuffled) windows for evaluation, strided across ranks.

        The windows of all sources are taken in order (source by source). Rank r takes
        windows r, r+W, ... of the first ``(n // W) * W`` windows, so every rank yields the
        same number of batches (the last may hold fewer than batch_size rows).
        """
        usable = (self.num_windows // self.world_size) * self.world_size
        mine = np.arange(self.rank, usable, self.world_size, dtype=np.int64)
        if mine.size == 0:
            raise ValueError(f"{self.shards.dir}: {self.num_windows} eval windows cannot feed "
                             f"{self.world_size} ranks; use more validation data or a "
                             f"smaller seq_len")
        starts = np.concatenate([[0], np.cumsum(self.windows_per_source)])
        for b, lo in enumerate(range(0, mine.size, self.batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            idx = mine[lo:lo + self.batch_size]
            src = np.searchsorted(starts, idx, side="right") - 1
            yield self._batch(idx - starts[src], src)
