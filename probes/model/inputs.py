"""Model inputs: pre-split words to pieces, one padding routine, length batches, piece -> word pooling.

Every sequence is ``[first special] pieces [last special]`` as the tokenizer adds them: [CLS] ... [SEP] for
BERT-style vocabularies, <s> ... </s> for RoBERTa-style ones, ``<s> ...`` (BOS only) for Llama-style causal
LMs, bare pieces for GPT-2-style ones. Word pooling uses (W, T) matrices with W = words + 2 always: row 0
is the first special, row W - 1 the last; a special the tokenizer does not add is an empty (all-zero) row
and column, so every cache keeps one layout.

Sentence pairs: an encoder's tokenizer joins them itself (``[CLS] A [SEP] B [SEP]``, ``<s> A </s></s> B </s>``).
A causal LM's tokenizer has no such form (GPT-2 and Qwen put nothing between the segments, Llama a second
BOS), so pairs of a tokenizer whose own pair template has no separator token between the segments are
joined by :func:`pair_separator` as ``[first special] A <sep> B [last special]`` (the decoder pair form):
``<sep>`` is the tokenizer's separator token, or its EOS where it has none (SmolLM2, GPT-2, Llama, Qwen);
the specials around are those of one sequence (a BOS where the tokenizer adds one); each segment has the
pieces it has alone (pre-split words as :func:`encode_words` makes them: byte-level BPE words with their
prefix space, in B as in A). Nothing follows B, so a classifier's last real token is B's last piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probes.model.families import special_ids

# How attention *from* a split word (rows) and *to* a split word (columns) is pooled over its
# pieces. Clark et al.: rows are averaged (mean), columns are summed (sum), so rows still sum to 1.
POOLINGS = ("mean", "sum", "first")


@dataclass
class Encoded:
    """One sequence in pieces: ids with the special tokens and the word of every piece."""

    input_ids: list[int]  # (T,)
    word_of_piece: list[int]  # (T,) -1 for the first special token, 0..n-1 for words, n for the last one
    n_words: int
    token_type_ids: list[int] | None = None  # (T,) sentence pairs only

    @property
    def n_pieces(self) -> int:
        return len(self.input_ids)


def encode_words(tokenizer, sentences: Sequence[Sequence[str]]) -> list[Encoded]:
    """Tokenize pre-split words (any family: WordPiece, byte-level BPE with prefix space, Unigram).

    A word with no pieces (e.g. a control character) becomes the unknown token, so every word has
    at least one piece; the special tokens are those the tokenizer itself adds before the first word
    (``word_of_piece`` -1) and after the last (``n``): [CLS]/[SEP], a causal LM's BOS, or none.
    """
    sentences = [list(s) for s in sentences]
    out = tokenizer(sentences, is_split_into_words=True, add_special_tokens=True)
    encoded = []
    for b, words in enumerate(sentences):
        ids, wids = out["input_ids"][b], out.word_ids(b)
        n = len(words)
        word_of_piece = _word_rows(wids, n)
        if word_of_piece is None:
            ids, wids = _encode_word_by_word(tokenizer, words)
            word_of_piece = _word_rows(wids, n)
        encoded.append(Encoded(list(ids), word_of_piece, n))
    return encoded


def _word_rows(wids: Sequence[int | None], n: int) -> list[int] | None:
    """Word of every piece: -1 for specials before the first word, n after the last; None when some word has
    no piece or a special sits between words (then the sentence is tokenized word by word)."""
    real = [i for i, w in enumerate(wids) if w is not None]
    if len({wids[i] for i in real}) != n or (real and real[-1] - real[0] + 1 != len(real)):
        return None
    return [w if w is not None else (-1 if i < real[0] else n) for i, w in enumerate(wids)]


def _encode_word_by_word(tokenizer, words: list[str]) -> tuple[list[int], list[int | None]]:
    pieces = tokenizer(words, is_split_into_words=False, add_special_tokens=False)["input_ids"]
    first, last = special_ids(tokenizer)
    ids, wids = list(first), [None] * len(first)
    for w, p in enumerate(pieces):
        p = p or [tokenizer.unk_token_id]
        ids += p
        wids += [w] * len(p)
    return ids + list(last), wids + [None] * len(last)


def encode_texts(tokenizer, text_a: str, text_b: str | None = None, max_length: int | None = None,
                 truncation: bool = False) -> Encoded:
    """One (pair of) raw text(s) as the model reads it: ``[CLS] a [SEP] (b [SEP])`` as the tokenizer makes it,
    or the decoder pair form (module doc) for a causal LM's pair; :func:`encode_text_batch` of one."""
    return encode_text_batch(tokenizer, [text_a], None if text_b is None else [text_b], max_length, truncation)[0]


def encode_text_batch(tokenizer, texts_a: Sequence[str], texts_b: Sequence[str] | None = None,
                      max_length: int | None = None, truncation: bool = False) -> list[Encoded]:
    """Raw texts (pairs when ``texts_b``), each as :func:`encode_texts`; ``truncation`` to ``max_length``
    pieces, specials included, cutting the longer segment first. ``word_of_piece`` is -1 throughout
    (raw texts have no words)."""
    if not texts_a:
        return []
    kw = dict(truncation=True, max_length=max_length) if truncation else {}
    sep = pair_separator(tokenizer) if texts_b is not None else None
    if sep is None:
        enc = tokenizer(list(texts_a), list(texts_b), **kw) if texts_b is not None else tokenizer(list(texts_a), **kw)
        tts = enc["token_type_ids"] if "token_type_ids" in enc else [None] * len(texts_a)
        return [Encoded(list(ids), [-1] * len(ids), 0, None if tt is None else list(tt))
                for ids, tt in zip(enc["input_ids"], tts)]
    first, last = special_ids(tokenizer)
    pa = tokenizer(list(texts_a), add_special_tokens=False)["input_ids"]
    pb = tokenizer(list(texts_b), add_special_tokens=False)["input_ids"]
    budget = None if not truncation else int(max_length) - len(first) - len(sep) - len(last)
    out = []
    for a, b in zip(pa, pb):
        a, b = _longest_first(list(a), list(b), budget)
        ids = [*first, *a, *sep, *b, *last]
        out.append(Encoded(ids, [-1] * len(ids), 0, None))
    return out


def text_offsets(tokenizer, text_a: str, text_b: str | None = None
                 ) -> tuple[list[int], list[int | None], list[tuple[int, int]]]:
    """:func:`encode_texts`' pieces (no truncation) with each piece's segment (0 = a, 1 = b, None for special
    tokens) and character span in its own text ((0, 0) for special tokens): ``(ids, segments, offsets)``."""
    sep = pair_separator(tokenizer) if text_b is not None else None
    if sep is None:
        texts = [text_a] if text_b is None else [text_a, text_b]
        enc = tokenizer(*texts, return_offsets_mapping=True)
        return list(enc["input_ids"]), list(enc.sequence_ids()), [tuple(o) for o in enc["offset_mapping"]]
    first, last = special_ids(tokenizer)
    ids, seg, offsets = list(first), [None] * len(first), [(0, 0)] * len(first)
    for k, text in enumerate((text_a, text_b)):
        if k:
            ids, seg, offsets = ids + sep, seg + [None] * len(sep), offsets + [(0, 0)] * len(sep)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids += list(enc["input_ids"])
        seg += [k] * len(enc["input_ids"])
        offsets += [tuple(o) for o in enc["offset_mapping"]]
    return ids + list(last), seg + [None] * len(last), offsets + [(0, 0)] * len(last)


def _longest_first(a: list[int], b: list[int], budget: int | None) -> tuple[list[int], list[int]]:
    """``a`` and ``b`` cut to ``budget`` pieces together, one piece at a time from the longer (b on a tie)."""
    if budget is None:
        return a, b
    if budget < 2:
        raise ValueError(f"max_length leaves {budget} pieces for a sentence pair")
    na, nb = len(a), len(b)
    while na + nb > budget:
        if na > nb:
            na -= 1
        else:
            nb -= 1
    return a[:na], b[:nb]


def pair_separator(tokenizer) -> list[int] | None:
    """The ids between the two segments of the decoder pair form (module doc): None where the tokenizer's own
    pair template puts its separator token between them (encoders: [SEP], </s></s>), else
    ``[sep_token_id]`` or, without one, ``[eos_token_id]`` (causal LMs). Read from the tokenizer only."""
    enc = tokenizer("a", "b", add_special_tokens=True)
    ids, seq = list(enc["input_ids"]), enc.sequence_ids()
    end_a = max(i for i, s in enumerate(seq) if s == 0)
    start_b = min(i for i, s in enumerate(seq) if s == 1)
    if tokenizer.sep_token_id is not None and tokenizer.sep_token_id in ids[end_a + 1:start_b]:
        return None
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if sep is None:
        raise ValueError(f"{type(tokenizer).__name__} joins sentence pairs without a separator and has neither a "
                         "sep nor an eos token to put between them")
    return [int(sep)]


def pad(seqs: Sequence[Sequence[int]], pad_id: int, type_ids: Sequence[Sequence[int] | None] | None = None
        ) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` (B, T) each, T = the longest; plus
    ``token_type_ids`` (B, T) when ``type_ids`` is given (None entries are all zero)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # (B,)
    B, T = len(seqs), int(lengths.max())
    real = torch.arange(T) < lengths[:, None]  # (B, T) True on each sequence's own positions, row by row
    input_ids = torch.full((B, T), int(pad_id if pad_id is not None else 0), dtype=torch.long)  # (B, T)
    input_ids[real] = torch.tensor([i for s in seqs for i in s], dtype=torch.long)
    mask = real.long()  # (B, T)
    tt = None
    if type_ids is not None:
        tt = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        for k, s in enumerate(seqs):
            if type_ids[k] is not None:
                tt[k, :len(s)] = torch.as_tensor(list(type_ids[k]), dtype=torch.long)
    out = dict(input_ids=input_ids, attention_mask=mask)
    if tt is not None:
        out["token_type_ids"] = tt
    return out


def pad_encoded(items: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """:func:`pad` of encoded sequences (token types when any item has them)."""
    types = [e.token_type_ids for e in items] if any(e.token_type_ids is not None for e in items) else None
    return pad([e.input_ids for e in items], pad_id, types)


def length_batches(lengths: Sequence[int], max_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Indices grouped by length (shortest first) so that batch size * longest <= max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and ((len(cur) + 1) * lengths[i] > max_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


def pooling_matrix(word_of_piece: Sequence[int], n_words: int, mode: str) -> torch.Tensor:
    """(W, T) matrix M with word attention = M_from @ A @ M_to^T; W = n_words + 2 (first special, words, last)."""
    if mode not in POOLINGS:
        raise ValueError(f"unknown pooling '{mode}', expected one of {POOLINGS}")
    T, W = len(word_of_piece), n_words + 2
    rows = torch.tensor([w + 1 for w in word_of_piece])  # (T,) row of each piece; first special -> 0
    m = torch.zeros(W, T)
    if mode == "first":
        first = torch.full((W,), -1, dtype=torch.long)
        for t in range(T - 1, -1, -1):
            first[rows[t]] = t
        has = first >= 0  # a special the tokenizer does not add keeps an empty row
        m[torch.arange(W)[has], first[has]] = 1.0
        return m
    m[rows, torch.arange(T)] = 1.0
    if mode == "mean":
        m = m / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    return m


def pool_attention(attn: torch.Tensor, from_mat: torch.Tensor, to_mat: torch.Tensor) -> torch.Tensor:
    """Word-level maps: attn (B, K, T, T) piece maps (K = layers * heads); from_mat, to_mat (B, W, T).

    Returns (B, K, W, W)."""
    return from_mat.unsqueeze(1) @ attn @ to_mat.unsqueeze(1).transpose(-1, -2)


def encode_word_pairs(tokenizer, pairs: Sequence[tuple[Sequence[str], Sequence[str]]]) -> list[Encoded]:
    """Sentence pairs of pre-split words as the tokenizer joins two segments: ``[CLS] A [SEP] B [SEP]``
    (RoBERTa-style: ``<s> A </s></s> B </s>``), with its token types (None where it has none); a causal LM's
    tokenizer (no separator in its pair template): the decoder pair form ``[BOS] A <sep> B`` (module doc,
    :func:`pair_separator`), no token types.

    ``word_of_piece``: -1 for the first special token (BOS; none without one), 0..nA-1 for A's words,
    nA..nA+nB-1 for B's, ``n_words`` = nA + nB for every other special token (the separator(s) between
    the segments and the last one), so pooling puts every separator into the last special row.
    """
    pairs = [(list(a), list(b)) for a, b in pairs]
    if not pairs:
        return []
    sep = pair_separator(tokenizer)
    if sep is not None:
        return _decoder_word_pairs(tokenizer, pairs, sep)
    out = tokenizer([a for a, _ in pairs], [b for _, b in pairs], is_split_into_words=True, add_special_tokens=True)
    encoded = []
    for k, (a, b) in enumerate(pairs):
        ids, wids, seq = out["input_ids"][k], out.word_ids(k), out.sequence_ids(k)
        tt = list(out["token_type_ids"][k]) if "token_type_ids" in out else None
        got = {(s, w) for s, w in zip(seq, wids) if w is not None}
        if got != {(0, w) for w in range(len(a))} | {(1, w) for w in range(len(b))} or wids[0] is not None \
                or wids[-1] is not None:
            ids, wids, seq, tt = _pair_word_by_word(tokenizer, a, b)
        n = len(a) + len(b)
        wop = [-1 if i == 0 else n if w is None else w + (len(a) if s == 1 else 0)
               for i, (w, s) in enumerate(zip(wids, seq))]
        encoded.append(Encoded(list(ids), wop, n, tt))
    return encoded


def _decoder_word_pairs(tokenizer, pairs: list[tuple[list[str], list[str]]], sep: list[int]) -> list[Encoded]:
    """The decoder pair form of pre-split words: each segment's pieces as :func:`encode_words` makes them
    (its specials dropped), joined as ``first A sep B last`` with the specials of one sequence."""
    first, last = special_ids(tokenizer)
    segs = encode_words(tokenizer, [s for pair in pairs for s in pair])
    encoded = []
    for k, (a, b) in enumerate(pairs):
        ea, eb = segs[2 * k], segs[2 * k + 1]
        n = len(a) + len(b)
        pa = [(i, w) for i, w in zip(ea.input_ids, ea.word_of_piece) if 0 <= w < len(a)]
        pb = [(i, w + len(a)) for i, w in zip(eb.input_ids, eb.word_of_piece) if 0 <= w < len(b)]
        ids = [*first, *(i for i, _ in pa), *sep, *(i for i, _ in pb), *last]
        wop = [-1] * len(first) + [w for _, w in pa] + [n] * len(sep) + [w for _, w in pb] + [n] * len(last)
        encoded.append(Encoded(ids, wop, n, None))
    return encoded


def _pair_word_by_word(tokenizer, a: list[str], b: list[str]):
    """(ids, word ids, sequence ids, token types) of a pair from :func:`encode_words`' pieces of each
    segment, joined by the tokenizer's own pair template (its specials and token types around 'a', 'b')."""
    t = tokenizer("a", "b", add_special_tokens=True)
    t_ids, t_seq = list(t["input_ids"]), list(t.sequence_ids())
    t_tt = list(t["token_type_ids"]) if "token_type_ids" in t else None
    ea, eb = encode_words(tokenizer, [a, b])
    segs = {0: (ea.input_ids[1:-1], ea.word_of_piece[1:-1]), 1: (eb.input_ids[1:-1], eb.word_of_piece[1:-1])}
    ids, wids, seq, tt, done = [], [], [], [] if t_tt is not None else None, set()
    for i, s in enumerate(t_seq):
        if s is None:
            ids.append(t_ids[i]), wids.append(None), seq.append(None)
            if tt is not None:
                tt.append(t_tt[i])
        elif s not in done:  # the template's pieces of 'a' / 'b' -> the segment's pieces
            done.add(s)
            p, w = segs[s]
            ids += p
            wids += w
            seq += [s] * len(p)
            if tt is not None:
                tt += [t_tt[i]] * len(p)
    return ids, wids, seq, tt
