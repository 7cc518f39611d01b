"""Sentences to padded batches: encoding in chunks, the long-sentence policy, length batches bounded in pieces and
attention pairs, the word pooling matrices of a batch, and building the next batch in a background thread while the
current one runs on a GPU (:func:`prefetched`, ``SentenceBatches(ahead=True)``)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch
from torch.utils.data import Dataset

from probes.maps.timing import stage
from probes.model.inputs import Encoded, encode_words, pad_encoded, pooling_matrix

log = logging.getLogger(__name__)

LONG_SENTENCES = ("skip", "error")  # what happens to a sentence longer than the limit


def encode_all(tokenizer, sentences: list[list[str]], chunk: int = 1024) -> list[Encoded]:
    """:func:`~probes.model.inputs.encode_words` in chunks (the tokenizer's batch output for a whole treebank is
    large)."""
    with stage("tokenize"):
        return [e for k in range(0, len(sentences), chunk) for e in encode_words(tokenizer, sentences[k:k + chunk])]


def select(encoded: list[Encoded], max_length: int, long_sentences: str) -> tuple[list[int], list[int]]:
    """(kept indices, too-long indices) under the long-sentence policy.

    Args:
        encoded: The encoded sentences.
        max_length: The most pieces a sentence may have, special tokens included.
        long_sentences: ``skip`` (left out, counted in the log) or ``error`` (a ValueError naming the first).
    """
    if long_sentences not in LONG_SENTENCES:
        raise ValueError(f"extract.long_sentences must be 'skip' or 'error', got '{long_sentences}'")
    too_long = [i for i, e in enumerate(encoded) if e.n_pieces > max_length]
    if too_long and long_sentences == "error":
        raise ValueError(f"{len(too_long)} sentences exceed {max_length} wordpieces (first: #{too_long[0]}); "
                         "set extract.long_sentences=skip to leave them out")
    if too_long:
        log.warning("%d of %d sentences exceed %d wordpieces and are left out of the cache (policy: skip)",
                    len(too_long), len(encoded), max_length)
    skipped = set(too_long)
    return [i for i in range(len(encoded)) if i not in skipped], too_long


def split_by_pairs(batches: list[list[int]], lengths: list[int], max_pairs: int | None) -> list[list[int]]:
    """Split length batches so that none holds more than ``max_pairs`` attention pairs (B * T^2): bounds the
    retained (B, H, T, T) maps of long sentences (memory) and keeps them cache-sized (speed); None or 0: as given."""
    if not max_pairs:
        return batches
    out = []
    for b in batches:
        T = max(lengths[i] for i in b)
        n = -(-len(b) * T * T // max_pairs)  # ceil: number of parts
        size = -(-len(b) // n)
        out += [b[k:k + size] for k in range(0, len(b), size)]
    return out


def pooling_matrices(items: list[Encoded], mode: str, T: int) -> torch.Tensor:
    """(B, W, T) word pooling matrices of a padded batch, W = most words + 2 (zero rows/columns pad);
    item k's block equals ``pooling_matrix(word_of_piece, n_words, mode)`` (built in one scatter)."""
    B, W = len(items), max(e.n_words for e in items) + 2
    out = torch.zeros(B, W, T)  # (B, W, T)
    if mode not in ("mean", "sum"):
        for k, e in enumerate(items):
            out[k, :e.n_words + 2, :e.n_pieces] = pooling_matrix(e.word_of_piece, e.n_words, mode)
        return out
    n = torch.tensor([e.n_pieces for e in items])  # (B,)
    b = torch.repeat_interleave(torch.arange(B), n)  # (N,) item of each piece
    t = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # (N,) its position
    w = torch.tensor([x for e in items for x in e.word_of_piece]) + 1  # (N,) its row: first special -> 0
    out[b, w, t] = 1.0
    if mode == "mean":
        out /= out.sum(-1, keepdim=True).clamp(min=1.0)
    return out


def make_batch(items: list[Encoded], indices: list[int], from_pool: str, to_pool: str, pad_id: int
               ) -> dict[str, torch.Tensor]:
    """One padded batch: input_ids, attention_mask (B, T) (and token_type_ids (B, T) when an item has them); from_mat,
    to_mat (B, W, T); index, n_words (B,)."""
    batch = pad_encoded(items, pad_id)  # input_ids, attention_mask (, token_type_ids): (B, T) each
    T = batch["input_ids"].shape[1]
    return dict(batch, from_mat=pooling_matrices(items, from_pool, T), to_mat=pooling_matrices(items, to_pool, T),
                index=torch.tensor(indices), n_words=torch.tensor([e.n_words for e in items]))


def pinned(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's tensors in page-locked host memory (their copy to a GPU can then run asynchronously)."""
    return {k: v.pin_memory() for k, v in batch.items()}


_DONE = object()  # the end of a prefetched iterable


def prefetched(items: Iterable, depth: int = 1) -> Iterator:
    """Iterate ``items`` in a background thread, at most ``depth`` items ahead of the consumer; an exception raised
    by ``items`` is re-raised here, at the item it replaced. Leaving the loop early stops the thread after the item
    it is producing.

    Args:
        items: Any iterable (e.g. a generator building padded batches).
        depth: How many produced items may wait (>= 1).
    """
    q: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((item, None))
        except BaseException as e:  # handed to the consumer, raised there
            q.put((None, e))
            return
        q.put((_DONE, None))

    worker = threading.Thread(target=produce, name="batches-ahead", daemon=True)
    worker.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass


class SentenceBatches(Dataset):
    """Each item is one padded batch of sentences (DataLoader with batch_size=None); pooling matrices are
    built here, i.e. in the loader's workers when num_workers > 0.

    With ``ahead``, each call also starts building the batch the loader will most likely ask for next (the index
    after this one, at the stride of the last two requests: 1 in order, the world size under a distributed
    sampler) in a background thread, so that it is ready when the current batch's forward is done; a request for
    another index builds that one at once (the result is the same either way), and an error while building is
    raised by the request for that batch. Meant for a GPU with ``num_workers=0``.

    Args:
        encoded: The sentences of the batches.
        indices: The index each of them is stored under (a batch's ``index``).
        batches: Positions in ``encoded`` of each batch's sentences.
        from_pool, to_pool: Pooling of the rows and of the columns (``mean``, ``sum``, ``first``).
        pad_id: The id padded positions hold.
        ahead: Build the next batch in a background thread.
        pin: Return batches in page-locked memory (for an asynchronous copy to a GPU; needs CUDA).
    """

    def __init__(self, encoded: list[Encoded], indices: list[int], batches: list[list[int]],
                 from_pool: str, to_pool: str, pad_id: int, ahead: bool = False, pin: bool = False):
        self.encoded, self.indices, self.batches = encoded, indices, batches
        self.from_pool, self.to_pool, self.pad_id = from_pool, to_pool, pad_id
        self.ahead, self.pin = bool(ahead), bool(pin)
        self._next: tuple[int, Future] | None = None  # (index, its build) started ahead
        self._last: int | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def __getstate__(self) -> dict:  # a loader worker gets the data, not the thread
        return dict(self.__dict__, _next=None, _last=None)

    def build(self, b: int) -> dict[str, torch.Tensor]:
        """Batch ``b``: :func:`make_batch` of its sentences (pinned with ``pin``)."""
        with stage("batch"):
            batch = make_batch([self.encoded[i] for i in self.batches[b]], [self.indices[i] for i in self.batches[b]],
                               self.from_pool, self.to_pool, self.pad_id)
            return pinned(batch) if self.pin else batch

    def _start(self, b: int) -> Future:
        """Build batch ``b`` in a new background thread (it ends with the build); its result or error."""
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(self.build(b))
            except BaseException as e:  # raised by the request for batch b
                done.set_exception(e)

        threading.Thread(target=run, name="batches-ahead", daemon=True).start()
        return done

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        if not self.ahead:
            return self.build(b)
        started, self._next = self._next, None
        if started is not None and started[0] == b:
            batch = started[1].result()  # re-raises an error of the build
        else:  # not the batch built ahead (which is dropped)
            batch = self.build(b)
        step = b - self._last if self._last is not None and b > self._last else 1
        self._last = b
        if b + step < len(self.batches):
            self._next = (b + step, self._start(b + step))
        return batch
