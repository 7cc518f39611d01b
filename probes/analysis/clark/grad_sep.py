"""``analysis=grad_sep``: how much the loss depends on attention to [SEP] (Clark et al. §3, Figure 3).

For every attention probability ``A[l, b, h, i, j]`` (layer l, head h, from wordpiece i to wordpiece j)
the gradient ``dLoss/dA`` is taken and averaged per layer over the probabilities whose *target*
``j`` is [SEP] (the family's separator: ``[SEP]``, RoBERTa's ``</s>``), a period/comma (``punct``:
pieces ``.`` / ``,`` once the marker ``##`` / ``Ġ`` / ``▁`` is stripped, Clark's definition, the same as
``analysis=head_stats``: :func:`probes.analysis.clark.metrics.is_period_comma`), or any other token
(``other``, [CLS] included); the three targets are disjoint and every valid (non-padding) row i and
column j counts.

How: the forward runs inside ``probes.model.hooks.attention(model, retain_grad=True)``, which keeps
each layer's attention probabilities (B, H, T, T) - the tensor multiplied with the values (eval mode:
no dropout) - and their ``.grad`` after ``backward()``, i.e. exactly ``dLoss/dA`` (checked against
``dLoss/dcontext . V`` in ``tests/test_gradients.py``). The weights stay frozen: the graph starts at
the word embeddings (``inputs_embeds`` with ``requires_grad``), so no parameter gradients are computed.

Loss (``objective``, Hydra ``_target_`` objects). Each objective says how its sequences are batched
(:meth:`Objective.batches`): per-sequence objectives (mlm, lm, classification) are batched by length and their batch
loss is the *sum over sequences of each sequence's own loss*; the contrastive objective runs one forward per fixed
group of pairs. Either way a sequence's gradients do not depend on ``max_tokens`` / ``max_batch_size``:

* :class:`MLMObjective` (Clark's choice): the first ``max_sentences`` sentences of the treebank
  ``split``, each ``[CLS] s [SEP]``; 15% of the non-special wordpieces of each sentence (at least
  one) are replaced by the mask token using a seeded ``torch.Generator``; the loss is the mean
  cross-entropy over the masked positions. The model is the encoder loaded with its MLM head
  (``instantiate(encoder, head="mlm")`` of the objective's ``encoder`` node, ``${encoder}`` in the config). A checkpoint without one (the packaged all-MiniLM-L6-v2
  is a sentence-embedding model) raises :class:`probes.model.load.MissingHeadError` naming the
  alternatives (for sentence-embedding encoders: ``objective=contrastive``, their own training loss);
  objectives are never swapped silently. Random-weight encoders (``random_init: true``,
  ``bert_base_random``, ``tiny``) get a random MLM head like the rest of their weights.
* :class:`ClassificationObjective`: a fine-tuned sequence classifier (``checkpoint``: GLUE run
  folder, its ``hf_model`` folder or a Lightning ``.ckpt``; :func:`probes.glue.export.load_finetuned`)
  scored on the first ``max_sentences`` examples of the GLUE ``split`` of its task
  (``[CLS] a [SEP] (b [SEP])``); loss = cross-entropy (squared error for one-label regression, STS-B).

* :class:`NextTokenObjective` (decoders, causal LMs: the counterpart of Clark's test for the
  "attention sink"): the first ``max_sentences`` treebank sentences of ``split`` as the model's
  tokenizer encodes pre-split words (its own BOS if it adds one); the loss is the mean next-token
  cross-entropy of the model's own LM head over the sequence (token t + 1 predicted from the logits at
  t). The model is the encoder loaded with its causal-LM head (``instantiate(encoder, head=<head>)``,
  ``head`` from the objective's config). The targets are ``first`` (position 0: BOS or the first word,
  where decoders park attention), ``punct`` and ``other``: :data:`LM_TARGETS`. Every key a causal row
  sees counts; keys a row cannot see (later tokens) have probability 0 and are left out.
* :class:`ContrastiveObjective` (sentence-embedding encoders: all-MiniLM-L6-v2 ``encoder=minilm``,
  all-mpnet-base-v2 ``encoder=mpnet_base``, trained with it): sentence-transformers'
  MultipleNegativesRankingLoss with in-batch negatives on paraphrase pairs, the first ``max_sentences``
  label-1 pairs of the GLUE task ``pairs_task`` (``mrpc``), split ``pairs_split`` (``train``; the
  analysis' ``split`` is not read), file order. Each sentence is encoded alone (``[CLS] s [SEP]``, truncated to
  ``max_length``); its embedding is the mean of the last hidden state over its real tokens, specials included
  (sentence-transformers' ``Pooling(mean)``); the loss of a group is the cross-entropy of each anchor's
  ``scale`` x cosine similarities to all positives of its group (the right one: the same index), averaged over
  the anchors. Groups are fixed: group k = pairs ``k*g .. k*g+g-1`` (``g = group_size``), one forward over its
  2g sentences (anchors then positives); a last group of one pair (no negative: loss 0) is dropped. The
  model is the encoder without a head (``head="base"``); targets :data:`TARGETS`.

Outputs: ``grad_sep.csv`` (layer, target, stat, value; 0-based layer; stats ``mean_abs``,
``mean``, ``count``), ``grad_sep.png`` (per-layer curves like Figure 3), ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from hydra.utils import instantiate
from tqdm import tqdm

from probes.analysis.clark.metrics import is_causal, is_period_comma, piece_strings
from probes.analysis.plots import layer_ticks
from probes.data.glue import read_glue
from probes.model import hooks
from probes.model.families import is_byte_level, usable_max_length
from probes.model.inputs import Encoded, encode_text_batch, encode_texts, encode_words, length_batches, pad
from probes.model.load import MissingHeadError
from probes.glue.export import load_finetuned

log = logging.getLogger(__name__)

TARGETS = ("sep", "punct", "other")        # encoders (mlm, classification): [SEP] is the candidate no-op
LM_TARGETS = ("first", "punct", "other")   # decoders (lm): the first token (the attention sink) is


@dataclass
class Model:
    """What an objective scores with: a frozen model with the project's attention path."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    max_length: int  # usable pieces incl. specials (RoBERTa: 512 of 514 positions)
    causal: bool = False  # a causal LM: rows see themselves and earlier tokens only


@dataclass
class Batch:
    """One padded batch of an objective."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T) 1 = real token
    labels: torch.Tensor  # (B, T) MLM (-100 = not scored) | (B,) classification
    token_type_ids: torch.Tensor | None = None  # (B, T) sentence pairs


# ----------------------------------------------------------------------------- objectives
def load_masked_lm(encoder_cfg) -> Model:
    """The encoder of the config node ``encoder_cfg`` (``conf/encoder/*.yaml``) with its masked-LM head
    (random for random-weight encoders); a checkpoint without one raises :class:`MissingHeadError`."""
    enc = instantiate(encoder_cfg, head="mlm")
    try:
        model = enc.model  # weights load here
    except MissingHeadError as e:
        raise MissingHeadError(f"grad_sep (objective=mlm): {e} Sentence-embedding encoders (encoder=minilm, "
                               "encoder=mpnet_base): analysis.objective=contrastive, their own training loss.") from e
    return Model(model, enc.tokenizer, enc.name, enc.max_length)


class Objective:
    """What every objective shares: its targets and how :func:`compute` batches its items."""

    targets = TARGETS

    def batches(self, items: list[dict], max_tokens: int, max_batch_size: int) -> list[list[int]]:
        """Indices of ``items`` per forward: by length (shortest first), batch size * longest <= ``max_tokens``
        and at most ``max_batch_size`` sequences (:func:`probes.model.inputs.length_batches`)."""
        return length_batches([len(it["ids"]) for it in items], max_tokens, max_batch_size)

    def summary(self, split: str) -> dict:
        """What ``summary.json`` records about the data read: the analysis' ``split``."""
        return dict(split=split)


class MLMObjective(Objective):
    """Masked-LM loss on ``[CLS] s [SEP]`` treebank sentences (see module doc)."""

    name = "mlm"

    def __init__(self, mask_prob: float = 0.15, seed: int = 0, encoder=None):
        """``encoder``: the encoder's config node (``${encoder}`` in ``conf/analysis/grad_sep.yaml``), loaded
        with its masked-LM head by :meth:`load`."""
        if not 0 < mask_prob < 1:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.mask_prob, self.seed, self.encoder = float(mask_prob), int(seed), encoder

    def load(self, ctx) -> Model:
        """The encoder with its masked-LM head (:func:`load_masked_lm`)."""
        if self.encoder is None:
            raise ValueError("grad_sep/mlm: analysis.objectives.mlm.encoder is not set (conf/analysis/grad_sep.yaml "
                             "sets it to ${encoder}, the encoder's config node)")
        return load_masked_lm(self.encoder)

    def sequences(self, ctx, tokenizer, split: str, max_sentences: int | None, max_length: int) -> list[dict]:
        """The first ``max_sentences`` sentences of ``split`` that fit ``max_length`` pieces (empty ones skipped)."""
        sents = ctx.sentences(split, max_sentences)
        enc = encode_words(tokenizer, [list(s.words) for s in sents])
        seqs = [dict(ids=e.input_ids) for e in enc if 2 < e.n_pieces <= max_length]
        if len(seqs) < len(enc):
            log.warning("grad_sep/mlm: %d of %d sentences skipped (empty or longer than %d wordpieces)",
                        len(enc) - len(seqs), len(enc), max_length)
        return seqs

    def mask(self, seqs: list[list[int]], tokenizer) -> tuple[list[list[int]], list[list[int]]]:
        """Masked copies and labels (-100 = not scored); deterministic given ``seed`` and the input order."""
        g = torch.Generator().manual_seed(self.seed)
        special = set(tokenizer.all_special_ids)
        out, labels = [], []
        for s in seqs:
            cand = [i for i, t in enumerate(s) if t not in special]
            n = max(1, int(round(self.mask_prob * len(cand))))
            pick = [cand[i] for i in torch.randperm(len(cand), generator=g)[:n].tolist()]
            m, lab = list(s), [-100] * len(s)
            for i in pick:
                lab[i] = s[i]
                m[i] = tokenizer.mask_token_id
            out.append(m)
            labels.append(lab)
        return out, labels

    def prepare(self, seqs: list[dict], tokenizer) -> list[dict]:
        """The sequences masked (:meth:`mask`), each ``dict(ids, labels)``."""
        masked, labels = self.mask([s["ids"] for s in seqs], tokenizer)
        return [dict(ids=m, labels=l) for m, l in zip(masked, labels)]

    def batch(self, items: list[dict], tokenizer) -> Batch:
        """Padded ids, mask and labels (padding -100) of ``items``."""
        x = pad([it["ids"] for it in items], tokenizer.pad_token_id)
        labels = pad([it["labels"] for it in items], -100)["input_ids"]  # (B, T), padding -100
        return Batch(x["input_ids"], x["attention_mask"], labels)

    def loss(self, out, batch: Batch) -> torch.Tensor:
        """Sum over sequences of each one's mean cross-entropy over its masked positions."""
        logits = out.logits.float()  # (B, T, V)
        labels = batch.labels.to(logits.device)  # (B, T)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                               reduction="none")  # (B, T)
        n = (labels != -100).sum(1).clamp(min=1)
        return (ce.sum(1) / n).sum()


class NextTokenObjective(Objective):
    """Next-token (causal LM) loss on treebank sentences, with the model's own LM head (see module doc)."""

    name = "lm"
    targets = LM_TARGETS

    def __init__(self, encoder=None, head: str = "causal_lm"):
        """``encoder``: the encoder's config node (``${encoder}``), loaded with its ``head`` by :meth:`load`."""
        self.encoder, self.head = encoder, head

    def load(self, ctx) -> Model:
        """The encoder with its causal-LM head; a checkpoint without one raises :class:`MissingHeadError`."""
        if self.encoder is None:
            raise ValueError("grad_sep/lm: analysis.objectives.lm.encoder is not set (conf/analysis/grad_sep.yaml "
                             "sets it to ${encoder}, the encoder's config node)")
        enc = instantiate(self.encoder, head=self.head)
        try:
            model = enc.model
        except MissingHeadError as e:
            raise MissingHeadError(f"grad_sep (objective=lm): {e}") from e
        return Model(model, enc.tokenizer, enc.name, enc.max_length, is_causal(enc))

    def sequences(self, ctx, tokenizer, split: str, max_sentences: int | None, max_length: int) -> list[dict]:
        """The first ``max_sentences`` sentences of ``split`` that fit ``max_length`` pieces (2 pieces at least)."""
        sents = ctx.sentences(split, max_sentences)
        enc = encode_words(tokenizer, [list(s.words) for s in sents])
        seqs = [dict(ids=e.input_ids) for e in enc if 2 <= e.n_pieces <= max_length]
        if len(seqs) < len(enc):
            log.warning("grad_sep/lm: %d of %d sentences skipped (one piece or longer than %d)",
                        len(enc) - len(seqs), len(enc), max_length)
        return seqs

    def prepare(self, seqs: list[dict], tokenizer) -> list[dict]:
        """Each sequence with its labels: the ids themselves (shifted in :meth:`loss`)."""
        return [dict(ids=s["ids"], labels=s["ids"]) for s in seqs]

    def batch(self, items: list[dict], tokenizer) -> Batch:
        """Padded ids, mask and labels (padding -100)."""
        x = pad([it["ids"] for it in items], tokenizer.pad_token_id)
        labels = pad([it["labels"] for it in items], -100)["input_ids"]  # (B, T), padding -100
        return Batch(x["input_ids"], x["attention_mask"], labels)

    def loss(self, out, batch: Batch) -> torch.Tensor:
        """Sum over sequences of each one's mean next-token cross-entropy (logits at t score token t + 1)."""
        logits = out.logits.float()[:, :-1]  # (B, T - 1, V)
        labels = batch.labels.to(logits.device)[:, 1:]  # (B, T - 1)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                               reduction="none")  # (B, T - 1)
        n = (labels != -100).sum(1).clamp(min=1)
        return (ce.sum(1) / n).sum()


class ClassificationObjective(Objective):
    """Loss of a fine-tuned sequence classifier on GLUE examples (see module doc).

    ``checkpoint``: GLUE run folder, ``hf_model`` folder or Lightning ``.ckpt`` (rebuilt on
    ``cfg.encoder``). ``task``: the GLUE task (None: the one the checkpoint was fine-tuned on; given,
    it must match). ``data_dir``: folder holding ``glue/`` (None: ``paths.data_dir``). ``examples``:
    hand-made :class:`~probes.data.glue.GlueExample` list instead of the GLUE files (tests).
    """

    name = "classification"

    def __init__(self, checkpoint: str | None = None, task: str | None = None, data_dir: str | None = None,
                 examples: list | None = None):
        self.checkpoint, self.task, self.data_dir, self.examples = checkpoint, task, data_dir, examples

    def load(self, ctx) -> Model:
        """The fine-tuned classifier of ``checkpoint`` (``ctx.encoder`` rebuilds a ``.ckpt``)."""
        if not self.checkpoint:
            raise ValueError("grad_sep/classification needs analysis.objectives.classification.checkpoint: a "
                             "fine-tuned GLUE run folder, its hf_model folder or a Lightning .ckpt")
        encoder = ctx.encoder if Path(str(self.checkpoint)).suffix == ".ckpt" else None
        ft = load_finetuned(self.checkpoint, encoder=encoder, task=self.task)
        if self.task is None:
            self.task = ft.task
        p = Path(ft.path)
        name = p.parent.name if p.name == "hf_model" else p.name
        return Model(ft.model, ft.tokenizer, name, usable_max_length(ft.model.config))

    def sequences(self, ctx, tokenizer, split: str, max_sentences: int | None, max_length: int) -> list[dict]:
        """The first ``max_sentences`` examples of the GLUE ``split`` (truncated to ``max_length``)."""
        if self.examples is None:
            if self.task is None:
                raise ValueError("grad_sep/classification: the checkpoint does not say which GLUE task it was "
                                 "fine-tuned on; set analysis.objectives.classification.task")
            examples = read_glue(self.task, split, self.data_dir or ctx.data_dir)
        else:
            examples = list(self.examples)
        out = []
        for ex in examples[:max_sentences]:
            e: Encoded = encode_texts(tokenizer, ex.text_a, ex.text_b, max_length=max_length, truncation=True)
            out.append(dict(ids=e.input_ids, type_ids=e.token_type_ids, label=ex.label))
        return out

    def prepare(self, seqs: list[dict], tokenizer) -> list[dict]:
        """The sequences unchanged."""
        return seqs

    def batch(self, items: list[dict], tokenizer) -> Batch:
        """Padded ids, mask, token types (pairs) and labels of ``items``."""
        types = [it["type_ids"] for it in items] if any(it["type_ids"] is not None for it in items) else None
        x = pad([it["ids"] for it in items], tokenizer.pad_token_id, types)
        return Batch(x["input_ids"], x["attention_mask"], torch.tensor([it["label"] for it in items]),
                     x.get("token_type_ids"))

    def loss(self, out, batch: Batch) -> torch.Tensor:
        """Summed cross-entropy (squared error for one-label regression) over the batch."""
        logits = out.logits.float()  # (B, C)
        labels = batch.labels.to(logits.device)  # (B,)
        if logits.shape[-1] == 1:
            return ((logits.squeeze(-1) - labels.float()) ** 2).sum()
        return torch.nn.functional.cross_entropy(logits, labels.long(), reduction="sum")


PARAPHRASE_TASKS = ("mrpc", "qqp")  # GLUE pair tasks whose label 1 means "paraphrase" / "duplicate"


class ContrastiveObjective(Objective):
    """In-batch-negative contrastive loss (sentence-transformers' MultipleNegativesRankingLoss) of a
    sentence-embedding encoder on paraphrase pairs, in fixed groups (see module doc)."""

    name = "contrastive"

    def __init__(self, encoder=None, scale: float = 20.0, group_size: int = 16, pairs_task: str = "mrpc",
                 pairs_split: str = "train", data_dir: str | None = None):
        """``encoder``: the encoder's config node (``${encoder}``), loaded without a head by :meth:`load`;
        ``scale``: multiplies the cosine similarities; ``group_size``: pairs per group (>= 2);
        ``pairs_task`` / ``pairs_split``: where the pairs come from; ``data_dir``: folder holding ``glue/``
        (None: ``paths.data_dir``)."""
        if int(group_size) != group_size or group_size < 2:
            raise ValueError(f"analysis.objectives.contrastive.group_size={group_size!r}: needs an integer >= 2 "
                             "(each anchor needs at least one in-group negative)")
        if not float(scale) > 0:
            raise ValueError(f"analysis.objectives.contrastive.scale={scale!r}: needs a positive number")
        if pairs_task not in PARAPHRASE_TASKS:
            raise ValueError(f"analysis.objectives.contrastive.pairs_task={pairs_task!r}: needs a GLUE task whose "
                             f"label 1 means paraphrase, one of {PARAPHRASE_TASKS}")
        self.encoder, self.scale, self.group_size = encoder, float(scale), int(group_size)
        self.pairs_task, self.pairs_split, self.data_dir = pairs_task, pairs_split, data_dir

    def load(self, ctx) -> Model:
        """The encoder without a head (its last hidden state is what is pooled)."""
        if self.encoder is None:
            raise ValueError("grad_sep/contrastive: analysis.objectives.contrastive.encoder is not set "
                             "(conf/analysis/grad_sep.yaml sets it to ${encoder}, the encoder's config node)")
        enc = instantiate(self.encoder, head="base")
        if enc.causal:
            raise ValueError(f"grad_sep/contrastive: {enc.name} is a causal LM; objective=contrastive is the "
                             "training loss of bidirectional sentence-embedding encoders (decoders: objective=lm)")
        return Model(enc.model, enc.tokenizer, enc.name, enc.max_length)

    def read_pairs(self, ctx, max_pairs: int | None) -> list:
        """The first ``max_pairs`` label-1 pairs of ``pairs_task`` / ``pairs_split`` (file order)."""
        examples = read_glue(self.pairs_task, self.pairs_split, self.data_dir or ctx.data_dir)
        pos = [ex for ex in examples if ex.text_b is not None and ex.label == 1]
        if not pos:
            raise ValueError(f"grad_sep/contrastive: {self.pairs_task} {self.pairs_split} has no label-1 sentence "
                             f"pairs (of {len(examples)} examples); set analysis.objectives.contrastive.pairs_task / "
                             "pairs_split")
        return pos[:max_pairs]

    def sequences(self, ctx, tokenizer, split: str, max_sentences: int | None, max_length: int) -> list[dict]:
        """The pairs' sentences in group order (anchors then positives of group 0, then group 1, ...), each
        ``dict(ids, group)``, truncated to ``max_length``; ``max_sentences`` counts pairs; ``split`` is not read
        (the pairs come from ``pairs_split``)."""
        pairs = self.read_pairs(ctx, max_sentences)
        g = self.group_size
        if len(pairs) % g == 1:
            log.warning("grad_sep/contrastive: the last pair is alone in its group (%d pairs, group_size %d) and "
                        "is dropped (no in-group negative: loss 0)", len(pairs), g)
            pairs = pairs[:-1]
        if not pairs:
            raise ValueError(f"grad_sep/contrastive: max_sentences={max_sentences} leaves no group of >= 2 pairs")
        anchors = encode_text_batch(tokenizer, [p.text_a for p in pairs], max_length=max_length, truncation=True)
        positives = encode_text_batch(tokenizer, [p.text_b for p in pairs], max_length=max_length, truncation=True)
        out = []
        for k, start in enumerate(range(0, len(pairs), g)):
            out += [dict(ids=e.input_ids, group=k) for e in anchors[start:start + g]]
            out += [dict(ids=e.input_ids, group=k) for e in positives[start:start + g]]
        return out

    def prepare(self, seqs: list[dict], tokenizer) -> list[dict]:
        """The sequences unchanged."""
        return seqs

    def batches(self, items: list[dict], max_tokens: int, max_batch_size: int) -> list[list[int]]:
        """One batch per group, in group order: its anchors then its positives (``max_tokens`` and
        ``max_batch_size`` are not used: the group is the unit of the loss)."""
        groups: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(it["group"], []).append(i)
        return list(groups.values())

    def batch(self, items: list[dict], tokenizer) -> Batch:
        """Padded ids and mask of one group's 2n sentences; labels (n,): the index of each anchor's positive."""
        if len(items) % 2:
            raise ValueError(f"grad_sep/contrastive: a group needs anchors and positives in equal numbers, got "
                             f"{len(items)} sentences")
        x = pad([it["ids"] for it in items], tokenizer.pad_token_id)
        return Batch(x["input_ids"], x["attention_mask"], torch.arange(len(items) // 2))

    def summary(self, split: str) -> dict:
        """The pairs' task and split (``split`` is not read), group size and scale."""
        return dict(split=self.pairs_split, pairs_task=self.pairs_task, group_size=self.group_size, scale=self.scale)

    def loss(self, out, batch: Batch) -> torch.Tensor:
        """Mean over the anchors of the cross-entropy of ``scale`` x cosine(anchor, every positive)."""
        h = out.last_hidden_state.float()  # (2n, T, E)
        m = batch.attention_mask.to(h.device, h.dtype)[..., None]  # (2n, T, 1)
        emb = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)  # (2n, E) mean over the real tokens
        emb = torch.nn.functional.normalize(emb, dim=-1)  # (2n, E)
        n = emb.shape[0] // 2
        scores = self.scale * emb[:n] @ emb[n:].T  # (n, n) anchors x positives
        return torch.nn.functional.cross_entropy(scores, batch.labels.to(scores.device))


# ----------------------------------------------------------------------------- gradients
def attention_gradients(model: torch.nn.Module, objective, batch: Batch, device: str) -> list[torch.Tensor]:
    """Per layer ``dLoss/dA`` (B, H, T, T) of one batch (see module doc for how)."""
    L = int(model.config.num_hidden_layers)
    with torch.enable_grad(), hooks.attention(model, retain_grad=True) as s:
        ids = batch.input_ids.to(device)  # (B, T)
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # (B, T, E)
        tt = batch.token_type_ids.to(device) if batch.token_type_ids is not None else None
        out = s.run(inputs_embeds=emb, attention_mask=batch.attention_mask.to(device), token_type_ids=tt)
        objective.loss(out, batch).backward()
        grads = [s.probs[l].grad if l in s.probs else None for l in range(L)]
    if any(g is None for g in grads):
        raise RuntimeError(f"{type(model).__name__}: no gradient for the attention probabilities of some layers")
    return [g.detach() for g in grads]


class Targets:
    """(B, T) masks of the three targets over the real tokens, for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        self.special = set(tokenizer.all_special_ids)
        self.byte_level = is_byte_level(tokenizer)
        self._punct: dict[int, bool] = {}

    def punct_ids(self, ids: torch.Tensor) -> list[int]:
        """The ids among ``ids`` that are a '.' or ',' piece (marker stripped; specials never)."""
        new = [i for i in torch.unique(ids).tolist() if i not in self._punct]
        for i, t in zip(new, piece_strings(self.tokenizer, new, self.byte_level)):
            self._punct[i] = i not in self.special and is_period_comma(t)
        return [i for i, p in self._punct.items() if p]

    def masks(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets=TARGETS
              ) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask (B, T) -> target -> (B, T) bool, disjoint: ``sep`` (the separator id)
        or ``first`` (position 0) as ``targets`` names, then ``punct``, then ``other`` (the rest)."""
        real = attention_mask.bool()
        sink = torch.zeros_like(real)  # (B, T)
        out = {}
        if "sep" in targets:
            out["sep"] = (input_ids == self.sep_id) & real
            sink |= out["sep"]
        if "first" in targets:
            out["first"] = torch.zeros_like(real)
            out["first"][:, 0] = real[:, 0]
            sink |= out["first"]
        punct = torch.isin(input_ids, torch.tensor(self.punct_ids(input_ids), dtype=input_ids.dtype)) & real & ~sink
        out.update(punct=punct, other=real & ~sink & ~punct)
        return out


class GradAccumulator:
    """Per layer and target: sums of |dL/dA| and dL/dA and the number of probabilities."""

    def __init__(self, num_layers: int, targets=TARGETS, causal: bool = False):
        """``causal``: count only the probabilities a row can see (key j <= query i)."""
        self.L, self.targets, self.causal = num_layers, tuple(targets), bool(causal)
        self.abs = {t: np.zeros(num_layers) for t in self.targets}
        self.sum = {t: np.zeros(num_layers) for t in self.targets}
        self.count = {t: np.zeros(num_layers, dtype=np.int64) for t in self.targets}
        self.n_sequences = 0

    def add(self, grads: list[torch.Tensor], masks: dict[str, torch.Tensor], attention_mask: torch.Tensor) -> None:
        """grads: per layer (B, H, T, T); masks: target -> (B, T); attention_mask (B, T) (real query rows)."""
        rows = attention_mask.bool()  # (B, T)
        H, T = grads[0].shape[1], rows.shape[1]
        seen = torch.ones(T, T, dtype=torch.bool).tril() if self.causal else torch.ones(T, T, dtype=torch.bool)
        for t in self.targets:
            sel = (rows[:, :, None] & masks[t][:, None, :] & seen)[:, None]  # (B, 1, Ti, Tj)
            n = int(sel.sum()) * H
            for l, g in enumerate(grads):
                v = g.double() * sel.to(g.device)  # (B, H, T, T), zero off the target
                self.abs[t][l] += float(v.abs().sum())
                self.sum[t][l] += float(v.sum())
                self.count[t][l] += n
        self.n_sequences += rows.shape[0]

    def table(self) -> pd.DataFrame:
        """Tidy (layer, target, stat, value) rows: mean_abs, mean, count."""
        rows = []
        for l in range(self.L):
            for t in self.targets:
                c = max(1, self.count[t][l])
                rows += [(l, t, "mean_abs", self.abs[t][l] / c), (l, t, "mean", self.sum[t][l] / c),
                         (l, t, "count", float(self.count[t][l]))]
        return pd.DataFrame(rows, columns=["layer", "target", "stat", "value"])


def compute(model, tokenizer, objective, items: list[dict], device: str = "cpu", max_tokens: int = 4096,
            max_batch_size: int = 32, progress: bool = True, causal: bool = False) -> GradAccumulator:
    """Accumulate per-layer gradient statistics over ``items`` (objective-prepared sequences), one forward per
    batch of ``objective.batches``; targets from the objective (``objective.targets``); ``causal``: only keys a
    row sees."""
    model = model.to(device)
    names = objective.targets
    acc = GradAccumulator(int(model.config.num_hidden_layers), names, causal=causal)
    targets = Targets(tokenizer)
    batches = objective.batches(items, max_tokens, max_batch_size)
    for b in tqdm(batches, desc="grad_sep", unit="batch", disable=None if progress else True):
        batch = objective.batch([items[i] for i in b], tokenizer)
        grads = attention_gradients(model, objective, batch, device)
        acc.add(grads, targets.masks(batch.input_ids, batch.attention_mask, names), batch.attention_mask)
    return acc


def figure(df: pd.DataFrame):
    """Figure 3: per layer, mean |dLoss/dA| and mean dLoss/dA for each target."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = {"sep": "[SEP]", "first": "first token", "punct": ". or ,", "other": "other"}
    for ax, stat, ylabel in zip(axes, ("mean_abs", "mean"), ("mean |dLoss/dA|", "mean dLoss/dA (signed)")):
        for t in [t for t in labels if t in set(df.target)]:
            label = labels[t]
            d = df[(df.target == t) & (df.stat == stat)].sort_values("layer")
            ax.plot(d.layer + 1, d.value, marker="o", label=label)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        layer_ticks(ax, int(df.layer.min()) + 1, int(df.layer.max()) + 1)
        if stat == "mean":
            ax.axhline(0, color="grey", lw=0.6)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def grad_sep(ctx, *, split: str = "dev", max_sentences: int | None = 1000, objective: Any = "mlm",
             objectives: dict | None = None, max_tokens: int = 4096, max_batch_size: int = 32,
             max_length: int | None = None) -> pd.DataFrame:
    """Mean gradient of the objective's loss w.r.t. attention to [SEP] / punctuation / other, per layer.

    ``split`` / ``max_sentences``: the split read and its first N sentences (mlm: treebank sentences;
    classification: GLUE examples; contrastive: N paraphrase pairs of its own ``pairs_split``), file order.
    ``max_length``: longest sequence in pieces (None: the model's usable length); longer sentences are skipped
    (mlm), longer examples and sentences truncated (classification, contrastive).
    """
    t0 = time.time()
    if isinstance(objective, str):
        if not objectives or objective not in objectives:
            raise ValueError(f"analysis.objective={objective!r}: not in analysis.objectives "
                             f"({sorted(objectives or {})})")
        objective = objectives[objective]
    m = objective.load(ctx)
    if max_length is not None and int(max_length) > m.max_length:
        raise ValueError(f"analysis.max_length={max_length} exceeds the {m.max_length} pieces {m.name} can read")
    max_length = int(max_length or m.max_length)
    seqs = objective.sequences(ctx, m.tokenizer, split, max_sentences, max_length)
    items = objective.prepare(seqs, m.tokenizer)
    log.info("grad_sep: %s objective, model %s, %d sequences, device %s", objective.name, m.name, len(items),
             ctx.device)
    acc = compute(m.model, m.tokenizer, objective, items, ctx.device, max_tokens, max_batch_size, causal=m.causal)
    df = acc.table()
    ctx.save_table(df, "grad_sep")
    ctx.save_figure(figure(df), "grad_sep")
    piv = df[df.stat != "count"].pivot_table(index=["stat", "target"], columns="layer", values="value")
    ctx.log_summary(dict(
        analysis="grad_sep", objective=objective.name, model=m.name, causal=m.causal, **objective.summary(split),
        max_length=max_length, n_sequences=acc.n_sequences, seconds=round(time.time() - t0, 1), device=ctx.device,
        per_layer={f"{s}/{t}": [float(v) for v in piv.loc[(s, t)].values] for s, t in piv.index}))
    log.info("grad_sep: %d sequences in %.1fs", acc.n_sequences, time.time() - t0)
    return df
