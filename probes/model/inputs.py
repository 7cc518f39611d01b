"""Model inputs: pre-split words to pieces, one padding routine, length batches, piece -> word pooling.

Every sequence is ``[first special] pieces [last special]`` as the tokenizer adds them: [CLS] ... [SEP] for
BERT-style vocabularies, <s> ... </s> for RoBERTa-style ones, ``<s> ...`` (BOS only) for Llama-style causal
LMs, bare pieces for GPT-2-style ones. Word pooling uses (W, T) matrices with W = words + 2 always: row 0
is the first special, row W - 1 the last; a special the tokenizer does not add is an empty (all-zero) row
and column, so every cache keeps one layout.
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
    """One (pair of) raw text(s) as the model's tokenizer makes it: ``[CLS] a [SEP] (b [SEP])``."""
    kw = dict(truncation=truncation, max_length=max_length) if truncation else {}
    enc = tokenizer(text_a, text_b, **kw) if text_b is not None else tokenizer(text_a, **kw)
    ids = list(enc["input_ids"])
    tt = list(enc["token_type_ids"]) if "token_type_ids" in enc else None
    return Encoded(ids, [-1] * len(ids), 0, tt)


def pad(seqs: Sequence[Sequence[int]], pad_id: int, type_ids: Sequence[Sequence[int] | None] | None = None
        ) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` (B, T) each, T = the longest; plus
    ``token_type_ids`` (B, T) when ``type_ids`` is given (None entries are all zero)."""
    B, T = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, T), int(pad_id if pad_id is not None else 0), dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    tt = torch.zeros(B, T, dtype=torch.long) if type_ids is not None else None  # (B, T)
    for k, s in enumerate(seqs):
        input_ids[k, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[k, :len(s)] = 1
        if tt is not None and type_ids[k] is not None:
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
    (RoBERTa-style: ``<s> A </s></s> B </s>``), with its token types (None where it has none).

    ``word_of_piece``: -1 for the first special token, 0..nA-1 for A's words, nA..nA+nB-1 for B's,
    ``n_words`` = nA + nB for every other special token (the separator(s) between the segments and
    the last one), so pooling puts every separator into the last special row.
    """
    pairs = [(list(a), list(b)) for a, b in pairs]
    if not pairs:
        return []
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
