"""dep_heads and coref_heads scored a batch of cached word maps at a time (``probes.analysis.cached.word_map_batches``
and ``word_row_batches``, ``DepAccumulator.add_batch``, ``CorefAccumulator.add_batch``: padded maps or rows, batched
tensor operations), against plain per-sentence loops written here.

The maps are those of a real attention cache of tiny random models (an encoder and a decoder) over the first UD
EWT dev sentences, some too long for the model (skipped by the cache, left out on both sides); batches are made
small so that they hold sentences of different lengths (padding). The references read each sentence's maps from
the cache and find every word's most-attended word, score the gold heads, the offsets and the antecedents by
explicit loops; nothing of the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from probes.analysis.cached import word_map_batches, word_row_batches
from probes.analysis.clark import dep_heads
from probes.analysis.clark.coref_heads import GROUPS, CorefAccumulator, EvaluatedMention, MentionLabels
from probes.data.sources import Treebank
from probes.extract.attention_caches import ensure_cache
from probes.extract.settings import ExtractSettings
from probes.model.tiny import tiny_folder
from tests.conftest import compose_train, require_shared

N_SENTENCES = 40
MAX_POSITIONS = 40  # EWT dev has longer sentences: the cache skips them
OFFSETS = [-3, -2, -1, 0, 1, 2]
EXCLUDE = ("root", "punct")


@pytest.fixture(scope="module", params=["bert", "llama"])
def cached(request, tmp_path_factory):
    """(causal, cache, sentences) of a tiny random model over the first EWT dev sentences."""
    data = require_shared("ud_english_ewt")
    root = tmp_path_factory.mktemp("cached-batches")
    folder = tiny_folder(request.param, root=root, max_positions=MAX_POSITIONS)
    cfg = compose_train(["encoder=auto", f"encoder.name_or_path={folder}", "extract.precision=32-true",
                         "extract.trainer.accelerator=cpu"])
    enc = instantiate(cfg.encoder)
    tb = Treebank(name="ud_english_ewt", data_dir=str(data.parent), subdir=data.name,
                  files={"dev": "en_ewt-ud-dev.conllu"}, download=False)
    cache, sentences = ensure_cache(enc, tb, "dev", ExtractSettings.from_config(cfg.extract), root / "cache",
                                    max_sentences=N_SENTENCES)
    held = [i for i in range(len(sentences)) if i in cache]
    assert 0 < len(held) < len(sentences)  # some sentences are skipped
    assert len({len(sentences[i].words) for i in held}) > 5  # lengths differ: batches are padded
    return request.param == "llama", cache, sentences


def most_attended_by_loops(a: np.ndarray, j: int, transpose: bool, causal: bool) -> np.ndarray:
    """(L, H) the 1-based word (1..n) that word j (1-based) attends to most (``transpose``: that attends most to
    j), itself and the specials ignored, the first of equal ones; ``causal``: only earlier words (later ones when
    ``transpose``), none: 0; a word with no other word: itself."""
    L, H, W, _ = a.shape
    n = W - 2
    cands = [k for k in range(1, n + 1) if k != j and (not causal or (k < j if not transpose else k > j))]
    out = np.zeros((L, H), dtype=np.int64)
    for l in range(L):
        for h in range(H):
            best, arg = -np.inf, (0 if causal else j)
            for k in cands:
                v = a[l, h, k, j] if transpose else a[l, h, j, k]
                if v > best:
                    best, arg = v, k
            out[l, h] = arg
    return out


def test_dep_heads_batches_equal_per_sentence_loops(cached):
    causal, cache, sentences = cached
    L, H = cache.num_layers, cache.num_heads
    count, before = {}, {}
    correct, off_correct = {}, {}
    for i, s in enumerate(sentences):
        if i not in cache:
            continue
        a = np.asarray(cache[i], dtype=np.float32)  # (L, H, W, W)
        n = len(s.words)
        for j in range(n):
            if s.heads[j] == 0 or s.deprels[j] in EXCLUDE:
                continue
            scored = j + 1  # Clark's possessive: a nmod:poss dependent followed by 's or ' is scored by the clitic
            if s.deprels[j] == "nmod:poss" and j + 1 < n and s.words[j + 1] in ("'s", "'", "’s", "’"):
                scored = j + 2
            for r in ("all", s.deprels[j]):
                count[r] = count.get(r, 0) + 1
                before[r] = before.get(r, 0) + int(s.heads[j] < scored)
                ok = np.stack([most_attended_by_loops(a, scored, t, causal) == s.heads[j] for t in (False, True)])
                correct[r] = correct.get(r, 0) + ok
                off_correct[r] = off_correct.get(r, 0) + np.array(
                    [max(0, min(scored + o, n)) == s.heads[j] for o in OFFSETS])
    # batches of about 0.05 MiB: several sentences of different lengths in each
    acc = dep_heads.evaluate(cache, sentences, L, H, OFFSETS, EXCLUDE, ("nmod:poss",), progress=False, causal=causal,
                             batch_mb=0.05)
    assert acc.n_sentences == sum(i in cache for i in range(len(sentences)))
    assert acc.count == count and acc.head_before == before
    for r in count:
        np.testing.assert_array_equal(acc.head_correct[r], correct[r], err_msg=r)
        np.testing.assert_array_equal(acc.offset_correct[r], off_correct[r], err_msg=r)


def test_word_map_batches_pad_with_zeros_and_cover_each_entry_once(cached):
    _, cache, sentences = cached
    n_words = [len(s.words) for s in sentences]
    seen = []
    for batch, maps, n in word_map_batches(cache, range(len(sentences)), n_words, budget_mb=0.05, progress=False):
        assert n.tolist() == [n_words[i] for i in batch]
        for b, i in enumerate(batch):
            W = n_words[i] + 2
            np.testing.assert_array_equal(maps[b, :, :, :W, :W].numpy(), np.asarray(cache[i], dtype=np.float32))
            assert not maps[b, :, :, W:].any() and not maps[b, :, :, :, W:].any()
        seen += batch
    assert sorted(seen) == [i for i in range(len(sentences)) if i in cache]
    with pytest.raises(ValueError, match="expected"):  # words that do not match the entry's side
        list(word_map_batches(cache, [seen[0]], [n_words[seen[0]] + 1], progress=False))


def test_word_row_batches_hold_the_chosen_rows_padded_with_zeros(cached):
    """Each entry's chosen rows (any order, repeats, [CLS] and [SEP] rows) are those of its whole maps read from the
    cache, in batch order, zeros beyond its side; every held entry once; a bad side or row is refused."""
    _, cache, sentences = cached
    n_words = [len(s.words) for s in sentences]
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(0, n + 2, size=int(rng.integers(1, 5)))) + [0, n + 1] for n in n_words]
    seen, mixed = [], False
    for batch, maps, n in word_row_batches(cache, range(len(sentences)), n_words, rows, budget_mb=0.05,
                                           progress=False):
        assert maps.dtype == torch.float16 and n.tolist() == [n_words[i] for i in batch]
        assert len(maps) == sum(len(rows[i]) for i in batch)
        mixed |= len(set(n.tolist())) > 1
        r0 = 0
        for i in batch:
            whole, W = np.asarray(cache[i]), n_words[i] + 2  # (L, H, W, W)
            for k, r in enumerate(rows[i]):
                np.testing.assert_array_equal(maps[r0 + k, :, :, :W].numpy(), whole[:, :, r, :])
                assert not maps[r0 + k, :, :, W:].any()
            r0 += len(rows[i])
        seen += batch
    assert mixed and sorted(seen) == [i for i in range(len(sentences)) if i in cache]
    with pytest.raises(ValueError, match="expected"):  # words that do not match the entry's side
        list(word_row_batches(cache, [seen[0]], [n_words[seen[0]] + 1], [[0]], progress=False))
    with pytest.raises(IndexError, match=f"no row {n_words[seen[0]] + 2}"):
        cache.rows(seen[0], [1, n_words[seen[0]] + 2])


def test_coref_batches_equal_per_mention_loops(cached):
    """Mentions drawn at random in each cached sentence (as if it were a segment): the batched counts equal a loop
    over the mentions, and the per-segment ``add`` gives the same."""
    _, cache, sentences = cached
    rng = np.random.default_rng(0)
    items, segs = [], []
    for i, s in enumerate(sentences):
        n = len(s.words)
        if i not in cache or n < 3:
            continue
        its = []
        for _ in range(int(rng.integers(0, 4))):  # some segments have none
            head = int(rng.integers(1, n))
            ants = frozenset(int(a) for a in rng.choice(head, size=int(rng.integers(1, min(head, 3) + 1)),
                                                        replace=False))
            its.append(EvaluatedMention("d", len(segs), head, str(rng.choice(GROUPS[1:])), ants,
                                        dict(nearest=max(ants), head_match=0, rule_based=0)))
        items.append(its)
        segs.append(i)
    L, H = cache.num_layers, cache.num_heads
    want = {g: np.zeros((L, H), dtype=np.int64) for g in GROUPS}
    for i, its in zip(segs, items):
        a = np.asarray(cache[i], dtype=np.float32)
        for it in its:
            pred = most_attended_by_loops(a, it.head + 1, False, False) - 1  # (L, H) local word
            hit = np.isin(pred, list(it.antecedent_heads))
            want["all"] += hit
            want[it.mtype] += hit
    assert want["all"].sum() > 0
    batched, single = CorefAccumulator(L, H), CorefAccumulator(L, H)
    labels = MentionLabels(items)
    scored = [k for k, its in enumerate(items) if its]
    for its in items:
        batched.add_mentions(its)
    mixed = False
    for batch, rows, n in word_row_batches(cache, [segs[k] for k in scored],
                                           [len(sentences[segs[k]].words) for k in scored],
                                           [[it.head + 1 for it in items[k]] for k in scored], budget_mb=0.05,
                                           progress=False):
        mixed |= len(set(n.tolist())) > 1
        index = torch.as_tensor([scored[[segs[k] for k in scored].index(i)] for i in batch])
        batched.add_batch(rows, n, labels, index)
    assert mixed  # padded batches
    for i, its in zip(segs, items):
        single.add(np.asarray(cache[i]), its)
    for acc in (batched, single):
        for g in GROUPS:
            np.testing.assert_array_equal(acc.correct[g], want[g], err_msg=g)
        assert acc.count["all"] == sum(len(its) for its in items)
        assert acc.base["all"]["nearest"] == acc.count["all"]
    assert batched.rows == single.rows
