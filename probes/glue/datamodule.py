"""GLUE fine-tuning data: tokenized single sentences or pairs, dynamic padding.

GLUE's test labels are private, so the dev set is used both as the validation set (model
selection: the best epoch by the task's main metric) AND as the "test" set reported by
`trainer.test` — `test/<metric>` is the dev score of the selected checkpoint, not a GLUE test score.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from probes.data.glue import GlueExample, glue_files, missing_file_message, read_glue, task_spec
from probes.model.inputs import encode_text_batch

log = logging.getLogger(__name__)


def tokenize(tokenizer, examples: list[GlueExample], max_length: int, regression: bool) -> list[dict]:
    """One feature dict per example (`input_ids`, `token_type_ids` where the tokenizer has them, `attention_mask`,
    `labels`, `idx`); pairs as the model layer joins them (:func:`probes.model.inputs.encode_text_batch`:
    ``[CLS] A [SEP] B [SEP]`` for encoders, ``[BOS] A <sep> B`` for causal LMs)."""
    if not examples:
        return []
    a = [e.text_a for e in examples]
    b = [e.text_b for e in examples] if examples[0].text_b is not None else None
    encoded = encode_text_batch(tokenizer, a, b, max_length=max_length, truncation=True)
    feats = []
    for enc, e in zip(encoded, examples):
        f = {"input_ids": enc.input_ids}
        if enc.token_type_ids is not None:
            f["token_type_ids"] = enc.token_type_ids
        f["attention_mask"] = [1] * enc.n_pieces
        f["labels"] = float(e.label) if regression else int(e.label)
        f["idx"] = e.idx
        feats.append(f)
    return feats


class Collator:
    """Pads a list of feature dicts to the longest sequence in the batch (dynamic padding)."""

    def __init__(self, pad_token_id: int, regression: bool):
        self.pad_token_id, self.regression = pad_token_id, regression

    def __call__(self, feats: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(f["input_ids"]) for f in feats)
        out = {}
        for k, pad in (("input_ids", self.pad_token_id), ("token_type_ids", 0), ("attention_mask", 0)):
            if k in feats[0]:
                out[k] = torch.tensor([f[k] + [pad] * (n - len(f[k])) for f in feats], dtype=torch.long)
        out["labels"] = torch.tensor([f["labels"] for f in feats],
                                     dtype=torch.float32 if self.regression else torch.long)
        out["idx"] = torch.tensor([f["idx"] for f in feats], dtype=torch.long)
        return out


class GlueDataModule(pl.LightningDataModule):
    """Train on `train` (optionally a seeded random subset), validate AND test on `dev` (see module doc)."""

    def __init__(self, task: str, encoder, data_dir: str, batch_size: int = 32, eval_batch_size: int = 64,
                 max_length: int = 128, max_train_examples: int | None = None,
                 max_eval_examples: int | None = None, seed: int = 0, num_workers: int = 0,
                 main_metric: str | None = None, name: str | None = None, test_split: str = "dev"):
        super().__init__()
        self.spec = task_spec(task)
        self.task = self.spec.name
        if main_metric is not None and main_metric != self.spec.main_metric:
            raise ValueError(f"data.main_metric={main_metric!r} but {self.task}'s main metric is "
                             f"{self.spec.main_metric!r}")
        self.encoder, self.data_dir = encoder, Path(data_dir)
        self.tokenizer = encoder.tokenizer
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_length = min(int(max_length), int(encoder.max_length))
        self.max_train_examples, self.max_eval_examples = max_train_examples, max_eval_examples
        self.seed, self.num_workers = seed, num_workers
        self.regression = self.spec.num_labels == 1
        self.collate = Collator(self.tokenizer.pad_token_id, self.regression)
        self.train_features: list[dict] | None = None
        self.dev_features: list[dict] | None = None
        self.n_train_available = 0
        # the split `trainer.test` scores (default the dev set again; MNLI: dev_mismatched, while
        # validation = model selection stays on `dev` = dev_matched)
        self.test_split = str(test_split)
        glue_files(self.task, self.test_split, self.data_dir)  # unknown split: error now
        self.test_features: list[dict] | None = None

    def prepare_data(self) -> None:
        """Nothing to download: check that the task's files are there (clear error otherwise)."""
        for split in dict.fromkeys(("train", "dev", self.test_split)):
            for p in glue_files(self.task, split, self.data_dir):
                if not p.is_file():
                    raise FileNotFoundError(missing_file_message(self.task, split, p))

    def examples(self, split: str) -> list[GlueExample]:
        """The examples of ``split``: train as a seeded random subset of ``max_train_examples``, the others
        cut to the first ``max_eval_examples``."""
        ex = read_glue(self.task, split, self.data_dir)
        if split == "train":
            self.n_train_available = len(ex)
            if self.max_train_examples is not None and len(ex) > self.max_train_examples:
                ex = random.Random(self.seed).sample(ex, int(self.max_train_examples))  # seeded subset
        elif self.max_eval_examples is not None:
            ex = ex[: int(self.max_eval_examples)]
        return ex

    def setup(self, stage: str | None = None) -> None:
        if self.dev_features is None:
            self.dev_features = tokenize(self.tokenizer, self.examples("dev"), self.max_length, self.regression)
        # the test split too, before training: a bad file is an error now, not after the last epoch
        if self.test_split != "dev" and stage in (None, "fit", "test") and self.test_features is None:
            self.test_features = tokenize(self.tokenizer, self.examples(self.test_split), self.max_length,
                                          self.regression)
        if stage in (None, "fit") and self.train_features is None:
            self.train_features = tokenize(self.tokenizer, self.examples("train"), self.max_length,
                                           self.regression)
            log.info("GLUE %s: %d train (of %d) / %d dev examples, max_length %d", self.task,
                     len(self.train_features), self.n_train_available, len(self.dev_features), self.max_length)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_features, batch_size=self.batch_size, shuffle=True, generator=g,
                          collate_fn=self.collate, num_workers=self.num_workers)

    def _dev(self):
        return DataLoader(self.dev_features, batch_size=self.eval_batch_size, shuffle=False,
                          collate_fn=self.collate, num_workers=self.num_workers)

    def val_dataloader(self):
        return self._dev()

    def test_dataloader(self):  # GLUE test labels are private: the dev set again (or `test_split`)
        if self.test_split == "dev":
            return self._dev()
        return DataLoader(self.test_features, batch_size=self.eval_batch_size, shuffle=False,
                          collate_fn=self.collate, num_workers=self.num_workers)

    def summary(self) -> dict[str, float]:
        """Examples per split and truncated dev examples, reported in ``metrics.json``."""
        out = {}
        if self.train_features is not None:
            out["data/n_train"] = float(len(self.train_features))
        if self.dev_features is not None:
            out["data/n_dev"] = float(len(self.dev_features))
        trunc = sum(len(f["input_ids"]) >= self.max_length for f in (self.dev_features or []))
        out["data/dev_truncated"] = float(trunc)
        return out
