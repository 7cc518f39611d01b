"""Model inputs: words to pieces as running text, one padding routine, length batches, piece -> word pooling.

Words are read as the model's own tokenizer reads the sentence they make, joined by single spaces
(:func:`encode_words`, :data:`WORD_ENCODING`), and must read back as that text (:func:`check_pieces`).

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
pieces it has alone (each segment running text on its own, as :func:`encode_words` makes it: a decoder's
first word of B as at the start of a text, as for A). Nothing follows B, so a classifier's last real token is B's last piece.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probes.model.families import special_ids

log = logging.getLogger(__name__)

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


# The rule by which pre-split words become pieces; part of every cache key (an entry made by another rule is never
# read). "running-text": the model's own tokenizer on the words joined by single spaces, each piece given to the
# word its characters come from (:func:`encode_words`).
WORD_ENCODING = "running-text"


class TokenizationError(ValueError):
    """The pieces of a sentence do not read back as its text: the tokenizer glues or splits its words."""


def check_words(sentences: Sequence[Sequence[str]], what: str = "sentence", first: int = 0) -> list[list[str]]:
    """``sentences`` as lists of non-empty strings without whitespace at either end; a clear error naming the
    sentence (numbered from ``first``), the word and its type otherwise (a bare string is not a list of words)."""
    out = []
    for i, words in enumerate(sentences, start=first):
        if isinstance(words, str) or not isinstance(words, Sequence):
            raise TypeError(f"{what} {i}: expected a list of words, got {type(words).__name__} {words!r:.60}")
        for j, w in enumerate(words):
            if not isinstance(w, str):
                raise TypeError(f"{what} {i}, word {j}: expected a string, got {w!r:.60} ({type(w).__name__}) "
                                f"in {list(words)!r:.120}")
            if not w.strip() or w != w.strip():
                raise ValueError(f"{what} {i}, word {j}: {w!r} is empty or starts/ends with whitespace; words are "
                                 f"joined by single spaces (in {list(words)!r:.120})")
        out.append(list(words))
    return out


def running_text(words: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
    """The words joined by single spaces and each word's character span ``(start, end)`` in that text."""
    spans, pos = [], 0
    for w in words:
        spans.append((pos, pos + len(w)))
        pos += len(w) + 1
    return " ".join(words), spans


def encode_words(tokenizer, sentences: Sequence[Sequence[str]]) -> list[Encoded]:
    """Pre-split words as the model reads running text (every tokenizer family; :data:`WORD_ENCODING`).

    Each sentence's words are joined by single spaces and tokenized by the model's own tokenizer, with its
    specials, exactly as the plain text would be: GPT-2/Llama/Qwen-style byte-level BPE reads ``The Ġcat``,
    SentencePiece ``▁The ▁cat``, WordPiece ``the cat``; RoBERTa and ModernBERT, whose tokenizers are loaded with
    ``add_prefix_space=True`` (:func:`probes.model.load.load_tokenizer`), ``ĠThe Ġcat``. Every piece belongs
    to the word its characters come from (its character offsets); a piece of spaces alone to the next word.
    Rules where a tokenizer does not split at the spaces, counted in the log: a piece that spans two words
    belongs to the word where it starts; a word left without a piece of its own (its text merged into a
    neighbour's piece, or removed by the tokenizer's normaliser) gets the unknown token in its place. The
    pieces must read back as the text (:func:`check_pieces`): a tokenizer that glues or splits words is a
    :class:`TokenizationError` before any forward. ``word_of_piece``: -1 for the specials before the first
    word, n after the last.
    """
    sentences = check_words(sentences)
    if not sentences:
        return []
    texts = [running_text(words) for words in sentences]
    out = tokenizer([t for t, _ in texts], add_special_tokens=True, return_offsets_mapping=True)
    spaced = spaces_in_pieces(tokenizer)
    encoded, merged, filled = [], 0, 0
    for b, (words, (text, spans)) in enumerate(zip(sentences, texts)):
        ids, wop, m, f = _assign_words(tokenizer, list(out["input_ids"][b]), out.sequence_ids(b),
                                       out["offset_mapping"][b], text, spans)
        merged, filled = merged + m, filled + f
        check_pieces(tokenizer, [i for i, w in zip(ids, wop) if 0 <= w < len(words)], text, spaced, sentence=b)
        encoded.append(Encoded(ids, wop, len(words)))
    if merged or filled:
        log.info("%s: %d piece(s) spanned two words (given to the word where they start), %d word(s) had no piece "
                 "of their own (read as the unknown token) in %d sentences", _name(tokenizer), merged, filled,
                 len(sentences))
    return encoded


def _assign_words(tokenizer, ids: list[int], seq: list[int | None], offsets, text: str,
                  spans: list[tuple[int, int]]) -> tuple[list[int], list[int], int, int]:
    """(ids, word of every piece, pieces spanning two words, words filled with the unknown token) of one sentence's
    running-text encoding; ``seq`` None marks the tokenizer's specials."""
    n = len(spans)
    char_word = [-1] * len(text)  # (C,) word of each character, -1 for the spaces between words
    inner_spaces = len(text.split()) != n  # some word holds whitespace (e.g. "10 000"): not its characters
    for k, (a, e) in enumerate(spans):
        char_word[a:e] = [k] * (e - a) if not inner_spaces else [-1 if text[c].isspace() else k for c in range(a, e)]
    content = [i for i, s in enumerate(seq) if s is not None]
    if content and content[-1] - content[0] + 1 != len(content):
        raise TokenizationError(f"{_name(tokenizer)} puts a special token between the words of {text!r:.80}")
    words, merged = [], 0
    for i in content:
        a, e = offsets[i]
        seg = char_word[a:e]  # the words of the piece's characters: nondecreasing apart from the -1 of spaces
        hit = [seg[0]] if seg and seg[0] >= 0 and seg[0] == seg[-1] else sorted({w for w in seg if w >= 0})
        if not hit:  # a piece of spaces alone (or with no characters): the next word's
            nxt = [char_word[c] for c in range(e, len(text)) if char_word[c] >= 0]
            hit = [nxt[0] if nxt else (words[-1] if words else 0)]
        merged += len(hit) > 1
        words.append(hit[0])
    first = content[0] if content else len(special_ids(tokenizer)[0])  # no piece at all: after the first specials
    head = ([-1] * first, ids[:first])
    tail_ids = ids[first + len(content):]
    body_ids = [ids[i] for i in content]
    missing = sorted(set(range(n)) - set(words))
    if missing:  # each such word gets the unknown token, in word order
        if tokenizer.unk_token_id is None:
            raise TokenizationError(f"{_name(tokenizer)}: word {missing[0]} ({text[slice(*spans[missing[0]])]!r}) of "
                                    f"{text!r:.80} has no piece of its own and the tokenizer has no unknown token")
        pairs = sorted([(w, t, i) for t, (w, i) in enumerate(zip(words, body_ids))] +
                       [(w, -1, tokenizer.unk_token_id) for w in missing])
        words, body_ids = [w for w, _, _ in pairs], [i for _, _, i in pairs]
    if words != sorted(words):
        raise TokenizationError(f"{_name(tokenizer)} reads the words of {text!r:.80} out of order")
    return head[1] + body_ids + tail_ids, head[0] + words + [n] * len(tail_ids), merged, len(missing)


def _name(tokenizer) -> str:
    return f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '') or 'unnamed'})"


def spaces_in_pieces(tokenizer) -> bool:
    """Whether the tokenizer's pieces carry the spaces of the text (byte-level BPE's ``Ġ``, SentencePiece's
    ``▁``): then the pieces decoded must give back exactly the text's spaces. WordPiece's pieces carry none (its
    decoder puts spaces back by rule: ``a.b`` reads back as ``a . b``); there the characters are checked and the
    words are split at the spaces by the tokenizer's pre-tokenizer whatever the pieces."""
    ids = tokenizer("a.b", add_special_tokens=False)["input_ids"]
    return _canon(tokenizer.decode(ids, clean_up_tokenization_spaces=False)).strip() == "a.b"


def _canon(s: str) -> str:
    """Text modulo what tokenizers' normalisers do: compatibility forms, accents, case, control characters; every
    whitespace character as a space."""
    if s.isascii() and s.isprintable():  # no compatibility form, accent or control character; spaces only
        return s.lower()
    s = unicodedata.normalize("NFKD", s)
    s = "".join(" " if c.isspace() else c for c in s
                if unicodedata.category(c) not in ("Mn", "Cc", "Cf") or c.isspace())
    return s.casefold()


def _reads_as(decoded: str, text: str, unk: str | None, spaced: bool, prefix: bool = False) -> bool:
    """Whether ``decoded`` (pieces decoded) reads as ``text`` (canonical forms, :func:`_canon`): the same
    characters and (``spaced``) the same spaces, no more and no fewer; the unknown token stands for any characters
    of one word. ``prefix``: ``decoded`` need only read as the start of ``text``."""
    d, t = _canon(decoded).strip(), _canon(text).strip()
    if not spaced:
        d, t = "".join(d.split()), "".join(t.split())
    if not prefix and (unk is None or unk not in decoded) and d == t:
        return True
    parts = re.split(f"({re.escape(_canon(unk))})", d) if unk else [d]
    pattern = ""
    for k, part in enumerate(parts):
        if k % 2:
            pattern += r"\S*?"
            continue
        for run in re.findall(r"\s+|\S", part):
            pattern += r"\s+" if run.isspace() else re.escape(run)
    return (re.match if prefix else re.fullmatch)(pattern, t) is not None


def check_pieces(tokenizer, ids: Sequence[int], text: str, spaced: bool | None = None, sentence: int | str = "") -> None:
    """Raise :class:`TokenizationError` unless the pieces ``ids`` (no specials) decoded read as ``text``
    (:func:`_reads_as`), naming the tokenizer, the sentence and the first differing piece."""
    spaced = spaces_in_pieces(tokenizer) if spaced is None else spaced
    unk = tokenizer.unk_token if tokenizer.unk_token_id is not None else None
    ids = list(ids)
    read = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if _reads_as(read, text, unk, spaced):
        return
    bad = next((t for t in range(1, len(ids) + 1)
                if not _reads_as(tokenizer.decode(ids[:t], clean_up_tokenization_spaces=False), text, unk, spaced,
                                 prefix=True)), len(ids))
    piece = tokenizer.convert_ids_to_tokens(ids[bad - 1]) if ids else None
    raise TokenizationError(
        f"{_name(tokenizer)} does not read sentence {sentence} as its text: {text!r:.200} reads back as "
        f"{read!r:.200}; first differing piece: #{bad - 1} {piece!r}. The tokenizer glues or splits words, so the "
        "model would read text no one writes; use a tokenizer that keeps the text's spaces")


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
        for k, (s, t) in enumerate(zip(seqs, type_ids)):
            if t is not None and len(t) != len(s):
                raise ValueError(f"sequence {k}: {len(t)} token type ids for {len(s)} ids")
        tt = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        tt[real] = torch.tensor([i for s, t in zip(seqs, type_ids) for i in (t if t is not None else [0] * len(s))],
                                dtype=torch.long)  # every sequence's types at once, as the ids
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


def check_pooling(mode: str, name: str = "pooling") -> None:
    """A ValueError unless ``mode`` is one of :data:`POOLINGS`; the message calls the value ``name`` (the config
    key the caller wrote, e.g. ``extract.from_words``)."""
    if mode not in POOLINGS:
        raise ValueError(f"{name}={mode!r} is not a pooling: expected one of {POOLINGS}")


def pooling_matrix(word_of_piece: Sequence[int], n_words: int, mode: str) -> torch.Tensor:
    """(W, T) matrix M with word attention = M_from @ A @ M_to^T; W = n_words + 2 (first special, words, last)."""
    check_pooling(mode)
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
    :func:`pair_separator`), no token types. Each segment is running text (:func:`encode_words`' rules and check).

    ``word_of_piece``: -1 for the first special token (BOS; none without one), 0..nA-1 for A's words,
    nA..nA+nB-1 for B's, ``n_words`` = nA + nB for every other special token (the separator(s) between
    the segments and the last one), so pooling puts every separator into the last special row.
    """
    pairs = [(list(a), list(b)) for a, b in pairs]
    if not pairs:
        return []
    check_words([s for pair in pairs for s in pair], what="segment")
    sep = pair_separator(tokenizer)
    if sep is not None:
        return _decoder_word_pairs(tokenizer, pairs, sep)
    texts = [(running_text(a), running_text(b)) for a, b in pairs]
    out = tokenizer([ta for (ta, _), _ in texts], [tb for _, (tb, _) in texts], add_special_tokens=True,
                    return_offsets_mapping=True)
    spaced = spaces_in_pieces(tokenizer)
    encoded = []
    for k, ((a, b), ((ta, sa), (tb, sb))) in enumerate(zip(pairs, texts)):
        ids, seq, offs = list(out["input_ids"][k]), out.sequence_ids(k), out["offset_mapping"][k]
        tt = list(out["token_type_ids"][k]) if "token_type_ids" in out else None
        n = len(a) + len(b)
        wop = [n] * len(ids)
        for s_id, words, text, spans, shift in ((0, a, ta, sa, 0), (1, b, tb, sb, len(a))):
            pos = [i for i, s in enumerate(seq) if s == s_id]
            seg_ids, seg_wop, _, missing = _assign_words(
                tokenizer, [ids[i] for i in pos], [0] * len(pos), [offs[i] for i in pos], text, spans)
            if missing or (pos and pos[-1] - pos[0] + 1 != len(pos)):
                raise TokenizationError(f"{_name(tokenizer)}: segment {s_id} of pair {k} ({text!r:.80}) has a word "
                                        "without a piece of its own or a special token inside")
            check_pieces(tokenizer, seg_ids, text, spaced, sentence=f"{k} (segment {s_id})")
            for i, w in zip(pos, seg_wop):
                wop[i] = w + shift
        if seq[0] is None:  # the first special token; every other special goes with the last special row
            wop[0] = -1
        encoded.append(Encoded(ids, wop, n, tt))
    return encoded


def _decoder_word_pairs(tokenizer, pairs: list[tuple[list[str], list[str]]], sep: list[int]) -> list[Encoded]:
    """The decoder pair form of pre-split words: each segment's pieces as :func:`encode_words` makes them (each
    segment running text on its own, its specials dropped), joined as ``first A sep B last`` with the specials of
    one sequence."""
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
