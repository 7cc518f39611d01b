"""The map engine: encoded sentences, a model, layers and a map kind -> piece maps or word maps, batch by batch.

Long sequences: a batch whose whole maps (L' x B x H x T x T floats) would exceed ``attention_budget_mb`` is computed
in blocks of query rows sized to that budget (:mod:`probes.model.blockwise`), each block reduced at once
(:mod:`probes.maps.reducers`: word maps, coarser units, head statistics) so that memory grows with the text, not its
square; shorter batches keep the whole-map path. Kinds that need every layer's whole map (rollout, flow, ...) are
refused beyond the budget, with the reason. A request whose reduced output cannot fit in the device's memory is
refused before any forward (:class:`MapMemoryError`), and running out of memory during a batch is reported with the
sizes and the settings to change.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from probes.config import plain
from probes.maps.batches import SentenceBatches, make_batch, pinned, prefetched, select, split_by_pairs
from probes.maps.reducers import FLOAT_BYTES, MatrixPool, Pool, Reducer
from probes.maps.timing import stage
from probes.measures import Measure, build
from probes.model.families import usable_max_length
from probes.model.inputs import Encoded, length_batches, pad_encoded
from probes.model.load import input_device
from probes.progress import Progress

MIB = 2 ** 20
# what the CPU allocator says when it cannot allocate (a CUDA device raises torch.OutOfMemoryError)
OUT_OF_MEMORY = re.compile(r"can't allocate memory|not enough memory|out of memory", re.IGNORECASE)
# a block of q query rows holds about this many (B, H, q, T) float32 tensors at once: its scores and probabilities,
# the mask rows, and the reducers' temporaries (measured: bench/long_context.py)
BLOCK_COPIES = 4
# at most this many query rows per block: a block computes the keys any of its rows may see, so smaller blocks skip
# more of what causal and sliding-window rows cannot see (Gemma 3 at 2,041 pieces: one block of all rows 15.0 s,
# blocks of 513 rows 8.8 s; bench/README.md); the budget may ask for fewer
MAX_BLOCK_ROWS = 512
# on a CPU, a block's (B, H, rows, T) float32 probabilities are kept near this many MiB, so that the passes over
# them (mask, softmax, reducers) run in the caches (2-vCPU EPYC: SmolLM2 at 8,186 pieces in blocks of 56 rows,
# 16 MiB, 194 s; of 512 rows 331 s; bench/README.md); a GPU takes the budget's blocks
CPU_BLOCK_MIB = 16


class MapMemoryError(MemoryError):
    """The maps asked for cannot fit: refused before the forward, or memory ran out during one (the message names
    the sizes and what to change)."""


def available_bytes(device: torch.device) -> int:
    """Memory the maps may still use on ``device``: a GPU's free memory plus what torch holds unused there; on the
    host, the kernel's ``MemAvailable`` (``/proc/meminfo``), else the physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:,.2f} GiB" if n >= 2 ** 30 else f"{n / MIB:,.1f} MiB"


def pad_id_of(tokenizer) -> int:
    """The id padded positions hold: the tokenizer's pad token, else 0 (the attention mask hides them)."""
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad_id is None else int(pad_id)


def pool_layers(probs: list[torch.Tensor], from_mat: torch.Tensor, to_mat: torch.Tensor,
                dtype: torch.dtype = torch.float16, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """Word-level maps, pooled one layer at a time in ``compute`` (no copy of all layers' piece maps).

    Args:
        probs: L x (B, H, T, T) piece maps in any float dtype.
        from_mat, to_mat: (B, W, T) pooling matrices of the rows and of the columns.
        dtype: The dtype of the result.
        compute: The dtype the products are computed in.

    Returns:
        (B, L, H, W, W) in ``dtype``.
    """
    B, H, T, _ = probs[0].shape
    W = from_mat.shape[1]
    out = torch.empty(B, len(probs), H, W, W, dtype=dtype, device=from_mat.device)  # (B, L, H, W, W)
    frm, to_t = from_mat.unsqueeze(1).to(compute), to_mat.transpose(1, 2).to(compute)  # (B, 1, W, T), (B, T, W)
    for l, a in enumerate(probs):
        # columns first as one (H*T, T) @ (T, W) product per sentence: fewer, larger matmuls
        cols = torch.bmm(a.to(compute).reshape(B, H * T, T), to_t).view(B, H, T, W)  # (B, H, T, W)
        out[:, l] = frm @ cols  # (B, H, W, W)
    return out


def stacked_maps(probs: list[torch.Tensor], lengths: torch.Tensor) -> torch.Tensor:
    """L' x (B, H', T, T) piece maps of a padded batch -> (B, L', H', T, T) float32, every entry outside item b's
    own ``lengths[b]`` rows and keys set to 0 (on the maps' device)."""
    maps = torch.stack(probs, 1).float()  # (B, L', H', T, T)
    T = maps.shape[-1]
    real = torch.arange(T, device=maps.device)[None, :] < lengths[:, None]  # (B, T)
    inside = (real[:, :, None] & real[:, None, :])[:, None, None]  # (B, 1, 1, T, T)
    return maps.masked_fill_(~inside, 0.0)


class MapEngine:
    """One way from encoded sentences to maps: length batches, the measure's piece maps of the chosen layers, and
    their word maps (rows pooled ``from_words``, columns ``to_words``).

    Args:
        model: The frozen model (eval mode, on the project's attention path).
        measure: The map kind (:mod:`probes.measures`; attention is :class:`probes.measures.attention.Attention`).
        layers: 0-based layers, in the order the maps hold them; None: all.
        from_words, to_words: Pooling of a word's rows and columns over its pieces (``mean``, ``sum``, ``first``).
        pad_id: The id of padded positions; None: ``tokenizer``'s pad token, else 0 (:func:`pad_id_of`).
        tokenizer: Where the pad id comes from when ``pad_id`` is None.
        device: Where :meth:`iter_piece_maps` and :meth:`iter_word_maps` move the model and the batches; None: the
            model stays where it is (a Lightning Trainer moves it) and batches go to its device.
        max_length: The most pieces a sentence may have (special tokens included); None: the model's usable length.
        max_tokens: Pieces per batch (batch size * longest sentence).
        max_batch_size: Sentences per batch.
        max_pairs: Attention pairs per batch (batch size * longest^2); None: no bound.
        pool_dtype: The dtype words are pooled in (:func:`probes.model.frozen.compute_in` yields it).
        attention_budget_mb: The most MiB the whole maps of one batch may take (L' x B x H' x T^2 float32); a batch
            above it is computed in blocks of query rows sized to it (attention), or refused (kinds that need
            whole maps).
        kind: The map kind's name, for messages (None: the measure's class).
    """

    def __init__(self, model: torch.nn.Module, measure: Measure, layers: Sequence[int] | None = None, *,
                 from_words: str = "mean", to_words: str = "sum", pad_id: int | None = None, tokenizer=None,
                 device: str | torch.device | None = None, max_length: int | None = None, max_tokens: int = 4096,
                 max_batch_size: int = 128, max_pairs: int | None = 65536, pool_dtype: torch.dtype = torch.float32,
                 attention_budget_mb: float = 1024, kind: str | None = None):
        self.model, self.measure = model, measure
        L = int(model.config.num_hidden_layers)
        self.layers = list(range(L)) if layers is None else [int(l) for l in layers]
        bad = [l for l in self.layers if not 0 <= l < L]
        if bad or not self.layers:
            raise ValueError(f"layers {list(self.layers)}: expected 0-based layers in 0..{L - 1} (the model has {L})")
        self.from_words, self.to_words = str(from_words), str(to_words)
        self.pad_id = int(pad_id) if pad_id is not None else pad_id_of(tokenizer)
        self.device = device
        self.max_length = None if max_length is None else int(max_length)
        self.max_tokens, self.max_batch_size = int(max_tokens), int(max_batch_size)
        self.max_pairs = None if not max_pairs else int(max_pairs)
        self.pool_dtype = pool_dtype
        self.budget = float(attention_budget_mb) * MIB
        if not self.budget > 0:
            raise ValueError(f"extract.attention_budget_mb must be > 0, got {attention_budget_mb}")
        self.kind = kind or type(measure).__name__

    @classmethod
    def from_config(cls, extract: Mapping | DictConfig, model: torch.nn.Module, *, kind: str | None = None,
                    layers: Sequence[int] | None = None, **kwargs) -> MapEngine:
        """The engine of an ``extract`` config node (conf/extract/default.yaml): its map kind (``kind`` instead of
        ``maps`` when given), layers (``layers`` instead when given), pooling, ``max_length`` and batching.

        Args:
            extract: The ``extract`` node (DictConfig, plain mapping or
                :class:`probes.extract.settings.ExtractSettings`).
            model: The frozen model.
            kind: The map kind, one of ``extract.measures``; None: ``extract.maps``.
            layers: 0-based layers; None: ``extract.layers`` (None there: all).
            **kwargs: Other constructor arguments (``tokenizer``, ``pad_id``, ``device``, ``pool_dtype``, or a
                setting of the node to replace).
        """
        x = plain(extract)
        kind = str(kind or x.get("maps") or "attention")
        settings = dict(from_words=x["from_words"], to_words=x["to_words"], max_length=x.get("max_length"),
                        max_tokens=x["max_tokens"], max_batch_size=x["max_batch_size"], max_pairs=x.get("max_pairs"),
                        attention_budget_mb=x["attention_budget_mb"], kind=kind)
        return cls(model, build(kind, x.get("measures")), x.get("layers") if layers is None else layers,
                   **{**settings, **kwargs})

    @property
    def num_heads(self) -> int:
        """H' of the maps: the model's heads for per-head kinds, else 1."""
        return self.measure.heads(int(self.model.config.num_attention_heads))

    def limit(self) -> int:
        """The most pieces a sentence may have: the least of ``max_length``, the model's usable length and the
        measure's ``max_pieces``."""
        n = usable_max_length(self.model.config)
        return min(self.max_length or n, n, self.measure.max_pieces or n)

    def select(self, encoded: Sequence[Encoded], long_sentences: str = "skip") -> tuple[list[int], list[int]]:
        """(kept indices, too-long indices) of ``encoded`` under :meth:`limit` and the long-sentence policy
        (``skip`` | ``error``; :func:`probes.maps.batches.select`)."""
        return select(list(encoded), self.limit(), long_sentences)

    def batches(self, encoded: Sequence[Encoded]) -> list[list[int]]:
        """Positions in ``encoded`` of each batch: by length (shortest first), at most ``max_tokens`` pieces,
        ``max_batch_size`` sentences and ``max_pairs`` attention pairs per batch."""
        lengths = [e.n_pieces for e in encoded]
        return split_by_pairs(length_batches(lengths, self.max_tokens, self.max_batch_size), lengths, self.max_pairs)

    def batch(self, items: Sequence[Encoded], indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """One padded batch (:func:`probes.maps.batches.make_batch`): input_ids, attention_mask (B, T); from_mat,
        to_mat (B, W, T); index, n_words (B,)."""
        return make_batch(list(items), list(indices), self.from_words, self.to_words, self.pad_id)

    def dataset(self, encoded: list[Encoded], indices: list[int], batches: list[list[int]],
                device: str | torch.device | None = None) -> SentenceBatches:
        """The batches as a Dataset of padded batches (a DataLoader with ``batch_size=None``).

        Args:
            encoded, indices, batches: See :class:`~probes.maps.batches.SentenceBatches`.
            device: Where the batches will run. On a CUDA device each batch is built in a background thread while
                the one before runs, in page-locked memory (its copy to the GPU runs asynchronously); elsewhere
                (a CPU, whose cores the forward uses) each is built when the loader asks for it.
        """
        gpu = device is not None and torch.device(device).type == "cuda"
        return SentenceBatches(encoded, indices, batches, self.from_words, self.to_words, self.pad_id,
                               ahead=gpu, pin=gpu)

    def piece_maps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   token_type_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """L' x (B, H', T, T) piece maps of the chosen layers (input_ids, attention_mask, token_type_ids of sentence
        pairs: (B, T), right-padded)."""
        with stage("forward"):
            return self.measure.layer_maps(self.model, input_ids, attention_mask, self.layers, token_type_ids)

    # ------------------------------------------------------------------------- whole maps or blocks
    def full_map_bytes(self, B: int, T: int) -> int:
        """Bytes of the whole maps of a batch of B sequences of T pieces: L' x B x H' x T^2 float32."""
        return len(self.layers) * B * self.num_heads * T * T * FLOAT_BYTES

    def rows_per_block(self, B: int, T: int) -> int | None:
        """None where the whole maps of a (B, T) batch fit ``attention_budget_mb`` (the whole-map path); else the
        query rows per block that keep a block's tensors (:data:`BLOCK_COPIES` x B x H x rows x T float32) within
        it, at least 1 and at most :data:`MAX_BLOCK_ROWS` (on a CPU also :data:`CPU_BLOCK_MIB` per tensor). A kind
        that needs whole maps is refused here (:class:`MapMemoryError`)."""
        full = self.full_map_bytes(B, T)
        if full <= self.budget:
            return None
        if not hasattr(self.measure, "reduce"):
            raise MapMemoryError(
                f"{self.kind} maps of a batch of {B} x {T} pieces need {_gib(full)} ({len(self.layers)} layers x {B} x "
                f"{self.num_heads} x {T}^2 floats), above extract.attention_budget_mb={self.budget / MIB:g}; "
                f"{self.kind} needs every layer's whole map at once (it combines whole maps across layers or solves on "
                f"them), so it cannot be computed in blocks of rows: raise extract.attention_budget_mb if the memory "
                f"is there, use shorter sequences (extract.max_length) or fewer layers, or use kind=attention, which "
                f"is computed in blocks")
        H = int(self.model.config.num_attention_heads)
        rows = int(self.budget // (BLOCK_COPIES * B * H * T * FLOAT_BYTES))
        device = torch.device(self.device) if self.device is not None else input_device(self.model)
        if device.type == "cpu":
            rows = min(rows, CPU_BLOCK_MIB * MIB // (B * H * T * FLOAT_BYTES))
        return max(1, min(T, MAX_BLOCK_ROWS, rows))

    def check_fits(self, reducer: Reducer, positions: Sequence[int], items: Sequence[Encoded], device: torch.device,
                   reduced: bool = True) -> None:
        """Refuse (:class:`MapMemoryError`, before any forward) a batch whose reduced output (``reducer``'s state)
        plus the working memory of its attention exceeds the memory available on ``device``
        (:func:`available_bytes`). The working memory: the budget of its blocks; on the whole-map path one layer's
        maps and their copies (``reduced``: each layer reduced before the next) or every layer's maps (kept until
        they are pooled, :meth:`word_maps`)."""
        B, T = len(items), max(e.n_pieces for e in items)
        state = reducer.nbytes(self.layers, self.num_heads, positions, items, device)
        rows = self.rows_per_block(B, T)
        if rows is not None:
            work = self.budget
        elif reduced:
            work = BLOCK_COPIES * B * int(self.model.config.num_attention_heads) * T * T * FLOAT_BYTES
        else:
            work = self.full_map_bytes(B, T)
        free = available_bytes(device)
        if state + work > free:
            raise MapMemoryError(
                f"the reduced maps ({type(reducer).__name__}) of {B} sequence(s) of up to {T} pieces, {len(self.layers)} "
                f"layers x {self.num_heads} heads, need {_gib(state)}, plus {_gib(work)} to compute the attention "
                f"(extract.attention_budget_mb={self.budget / MIB:g}); {device} has {_gib(free)} available. Ask for "
                f"fewer layers, a coarser unit (sentences, spans of N pieces instead of words), or shorter sequences")

    @contextlib.contextmanager
    def _memory_errors(self, B: int, T: int, rows: int | None) -> Iterator[None]:
        """Running out of memory inside the block is re-raised as :class:`MapMemoryError` naming the batch, the
        path taken and the settings to change."""
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as e:
            text = str(e)
            if not isinstance(e, torch.OutOfMemoryError) and not OUT_OF_MEMORY.search(text):
                raise
            path = ("whole maps" if rows is None else
                    f"blocks of {rows} query rows")
            raise MapMemoryError(
                f"out of memory computing {self.kind} maps of a batch of {B} x {T} pieces ({len(self.layers)} layers, "
                f"{path}, extract.attention_budget_mb={self.budget / MIB:g}): set extract.attention_budget_mb lower "
                f"(smaller blocks; whole maps only below it), extract.max_tokens lower (smaller batches), or ask for "
                f"fewer layers or a coarser unit. ({type(e).__name__}: {text.splitlines()[0] if text else ''})") from e

    def reduce(self, inputs: Mapping[str, torch.Tensor], reducer: Reducer, positions: Sequence[int],
               items: Sequence[Encoded], batched: bool = False):
        """The ``reducer``'s results (one per item; ``batched``: its :meth:`~probes.maps.reducers.Reducer.batch_results`)
        of one padded batch of ``items`` (input_ids, attention_mask (, token_type_ids): (B, T) on the model's
        device): whole maps as one block each, or blocks of query rows (:meth:`rows_per_block`)."""
        ids = inputs["input_ids"]
        B, T = ids.shape
        rows = self.rows_per_block(B, T)
        reducer.start(self.layers, self.num_heads, positions, items, T, ids.device)
        with stage("forward"), self._memory_errors(B, T, rows):
            self.measure.reduce(self.model, ids, inputs["attention_mask"], self.layers, reducer, rows,
                                inputs.get("token_type_ids"))
        return reducer.batch_results() if batched else reducer.results()

    def word_maps(self, batch: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """(B, L', H', W, W) word maps of a :meth:`batch` (pooled in ``pool_dtype``, outside autocast); a batch
        whose whole maps exceed the budget in blocks of rows (:meth:`rows_per_block`), pooled block by block."""
        B, T = batch["input_ids"].shape
        rows = self.rows_per_block(B, T)
        if rows is not None:
            pool = MatrixPool(batch["from_mat"], batch["to_mat"])
            items = [Encoded([], [], 0)] * B  # the units come from the matrices
            with torch.autocast(batch["input_ids"].device.type, enabled=False):
                return torch.stack(self.reduce(batch, pool, range(B), items)).to(dtype)
        with self._memory_errors(B, T, None):
            probs = self.piece_maps(batch["input_ids"], batch["attention_mask"],
                                    batch.get("token_type_ids"))  # L' x (B, H', T, T)
            with torch.autocast(probs[0].device.type, enabled=False), stage("pool"):
                return pool_layers(probs, batch["from_mat"], batch["to_mat"], dtype, self.pool_dtype)

    def _on_device(self) -> torch.device:
        """The device batches go to (the model moved to ``device`` first when it is set)."""
        if self.device is not None:
            self.model.to(self.device)
            return torch.device(self.device)
        return input_device(self.model)  # a model placed across devices: its main device

    def _iter(self, items: Sequence[Encoded], desc: str, progress: bool, make, step) -> Iterator:
        """Run ``step(device, positions, their items, make(positions, their items))`` over :meth:`batches` of
        ``items`` without gradients, with a tqdm bar on a terminal and progress lines in the log otherwise; yields
        what ``step`` yields. On a CUDA device the next batch is made (in page-locked memory) in a background thread
        while the current one runs (:func:`~probes.maps.batches.prefetched`)."""
        device = self._on_device()
        gpu = device.type == "cuda"

        def made() -> Iterator:
            for b in self.batches(items):
                its = [items[k] for k in b]
                with stage("batch"):
                    host = make(b, its)
                    yield b, its, pinned(host) if gpu else host

        with torch.inference_mode(), \
                tqdm(total=len(items), desc=desc, unit="seq", disable=None if progress else True) as bar, \
                Progress(desc, len(items), "sequences", enabled=None if progress else False) as lines:
            for b, its, host in (prefetched(made()) if gpu else made()):
                yield from step({k: v.to(device, non_blocking=gpu) for k, v in host.items()}, b, its)
                bar.update(len(b))
                lines.update(len(b))

    def iter_piece_maps(self, items: Sequence[Encoded], desc: str = "maps", progress: bool = True
                        ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(k, (L', H', T_k, T_k) float32 piece maps)`` of every ``items[k]``, in batch order (a sentence's
        block equals running it alone: padded keys get nothing)."""
        def step(inp, positions, its):  # inp: input_ids, attention_mask (, token_type_ids): (B, T) each
            maps = torch.stack(self.piece_maps(inp["input_ids"], inp["attention_mask"], inp.get("token_type_ids")),
                               1).float()  # (B, L', H', T, T)
            for j, (k, it) in enumerate(zip(positions, its)):
                t = it.n_pieces
                yield k, maps[j, :, :, :t, :t]

        return self._iter(items, desc, progress, lambda positions, its: pad_encoded(its, self.pad_id), step)

    def iter_piece_map_batches(self, items: Sequence[Encoded], desc: str = "maps", progress: bool = True
                               ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Yield ``(positions, lengths, maps)`` for every batch of ``items``, nothing split per item or copied to the
        host: the positions of its items in ``items``, ``lengths`` (B,) long their pieces and ``maps``
        (B, L', H', T, T) float32 their piece maps, on the maps' device. Item j's block ``maps[j, :, :, :t, :t]``
        (t = ``lengths[j]``) equals :meth:`iter_piece_maps`' map of it; every entry outside it (padded rows and
        columns) is 0."""
        def step(inp, positions, its):  # inp: input_ids, attention_mask (, token_type_ids): (B, T) each
            probs = self.piece_maps(inp["input_ids"], inp["attention_mask"], inp.get("token_type_ids"))
            lengths = torch.as_tensor([it.n_pieces for it in its], device=probs[0].device)  # (B,)
            yield list(positions), lengths, stacked_maps(probs, lengths)

        return self._iter(items, desc, progress, lambda positions, its: pad_encoded(its, self.pad_id), step)

    def iter_word_maps(self, items: Sequence[Encoded], dtype: torch.dtype = torch.float32, desc: str = "word maps",
                       progress: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(k, (L', H', W_k, W_k) word maps in dtype)`` of every ``items[k]``, in batch order; W_k =
        its words + 2 (first special, words, last special; a special the tokenizer does not add is a zero row).
        Batches above the budget are computed in blocks and pooled by :class:`~probes.maps.reducers.Pool` (no
        pooling matrices); a batch whose word maps cannot fit is refused before any forward."""
        pool = Pool(from_units=self.from_words, to_units=self.to_words)
        self._check_batches(items, pool, reduced=False)

        def make(positions, its):
            if self.rows_per_block(len(its), max(e.n_pieces for e in its)) is None:
                return self.batch(its, positions)
            return pad_encoded(its, self.pad_id)

        def step(batch, positions, its):
            if "from_mat" in batch:
                maps = self.word_maps(batch, dtype)  # (B, L', H', W, W)
                for j, (k, it) in enumerate(zip(positions, its)):
                    w = it.n_words + 2
                    yield k, maps[j, :, :, :w, :w]
                return
            for k, m in zip(positions, self.reduce(batch, pool, positions, its)):
                yield k, m.to(dtype)  # (L', H', W_k, W_k)

        return self._iter(items, desc, progress, make, step)

    def iter_reduced(self, items: Sequence[Encoded], reducer: Reducer, desc: str = "reduced maps",
                     progress: bool = True) -> Iterator[tuple[int, object]]:
        """Yield ``(k, result)`` of ``reducer`` (:mod:`probes.maps.reducers`) for every ``items[k]``, in batch order:
        the attention of the chosen layers handed to the reducer as whole maps, or in blocks of query rows when a
        batch's whole maps exceed the budget (documents: no whole map). Refused before any forward when a batch's
        reduced output cannot fit (:meth:`check_fits`) or the kind cannot be reduced."""
        def step(inp, positions, its):
            yield from zip(positions, self.reduce(inp, reducer, positions, its))

        return self._iter_reduce(items, reducer, desc, progress, step)

    def iter_reduced_batches(self, items: Sequence[Encoded], reducer: Reducer, desc: str = "reduced maps",
                             progress: bool = True) -> Iterator[tuple[list[int], object]]:
        """Yield ``(positions, batch result)`` for every batch of ``items``: the positions of its items in ``items``
        and ``reducer``'s :meth:`~probes.maps.reducers.Reducer.batch_results` (batched tensors on the maps' device,
        leading dim B in the order of ``positions``), as :meth:`iter_reduced` computes them; nothing is split per
        item or copied to the host."""
        def step(inp, positions, its):
            yield list(positions), self.reduce(inp, reducer, positions, its, batched=True)

        return self._iter_reduce(items, reducer, desc, progress, step)

    def _iter_reduce(self, items: Sequence[Encoded], reducer: Reducer, desc: str, progress: bool, step) -> Iterator:
        """:meth:`_iter` of padded batches through ``step`` once the kind is known to reduce and every batch to fit
        (both refused before any forward)."""
        if not hasattr(self.measure, "reduce"):
            raise ValueError(f"{self.kind} maps cannot be reduced block by block (it needs every layer's whole map); "
                             "use kind=attention, or iter_word_maps / iter_piece_maps")
        self._check_batches(items, reducer)
        return self._iter(items, desc, progress, lambda positions, its: pad_encoded(its, self.pad_id), step)

    def _check_batches(self, items: Sequence[Encoded], reducer: Reducer, reduced: bool = True) -> None:
        """:meth:`check_fits` of every batch of ``items`` (and :meth:`rows_per_block`'s refusal), before any
        forward."""
        if not items:
            return
        device = torch.device(self.device) if self.device is not None else input_device(self.model)
        for b in self.batches(items):
            self.check_fits(reducer, b, [items[k] for k in b], device, reduced)
