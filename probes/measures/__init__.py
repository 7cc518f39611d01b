"""Token-to-token maps beyond attention weights (issue 12): one measure object per map kind.

Every measure is called as ``measure(model, input_ids, attention_mask)`` on a right-padded batch and
returns one tensor per layer, ``L x (B, H', T, T)`` (float32; attention: the compute dtype), with
rows = the receiving position i and columns = the contributing position j (like attention: "i attends to j"); H' = the model's heads for
per-head measures (``per_head = True``), 1 for per-layer ones. Positions beyond a sentence's length
are zero or arbitrary and are cropped by the caller, so a sentence's block equals running it alone.
All model access goes through :mod:`probes.model.hooks`.

Kinds (``extract.maps=<kind>``; objects from ``extract.measures.<kind>`` in conf/extract/default.yaml):
``attention``, ``rollout``, ``flow`` (:mod:`.rollout`), ``norm``, ``norm_res_ln``, ``alti``
(:mod:`.norms`), ``value_zeroing`` (:mod:`.value_zeroing`), ``grad_attribution`` (:mod:`.gradient`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from hydra.utils import instantiate
from tqdm import tqdm

from probes.model.inputs import length_batches, pad_encoded


class Measure:
    """Base class: ``__call__(model, input_ids (B, T), attention_mask (B, T)) -> L x (B, H', T, T)``."""

    per_head: bool = True
    max_pieces: int | None = None  # longest sequence (special tokens included) the measure accepts; None: any

    def heads(self, num_heads: int) -> int:
        """H' of the maps: the model's heads for per-head measures, else 1."""
        return num_heads if self.per_head else 1

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                 ) -> list[torch.Tensor]:
        raise NotImplementedError


def build(maps: str, measures: Mapping | None) -> Measure:
    """The measure of kind ``maps`` from the ``extract.measures`` node (``{kind: {_target_: ...}}``)."""
    measures = dict(measures or {"attention": {"_target_": "probes.measures.attention.Attention"}})
    if maps not in measures:
        raise KeyError(f"extract.maps={maps!r} is not one of extract.measures: {', '.join(measures)}")
    return instantiate(measures[maps])


def from_config(extract_cfg: Mapping) -> tuple[str, Measure]:
    """``(kind, measure)`` of an ``extract`` config node (``maps`` and ``measures``; attention when absent)."""
    kind = str(extract_cfg.get("maps", "attention") or "attention")
    return kind, build(kind, extract_cfg.get("measures"))


def lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real length of every row of a right-padded (B, T) mask."""
    return [int(n) for n in attention_mask.sum(-1).tolist()]


def sentence_rows(rows, n: int) -> list[int]:
    """Rows of a sentence of ``n`` pieces, in order: a negative row counts from the sentence's end (-1 = its
    last piece: what a decoder's last-token classifier reads); rows outside the sentence are dropped."""
    return [r for r in ((r + n if r < 0 else r) for r in rows) if 0 <= r < n]


def per_sentence(fn, input_ids: torch.Tensor, attention_mask: torch.Tensor, L: int, H: int) -> list[torch.Tensor]:
    """Run ``fn(ids (n,)) -> (L, H, n, n)`` on every sentence alone; L x (B, H, T, T) zero-padded."""
    B, T = input_ids.shape
    out = torch.zeros(L, B, H, T, T, device=input_ids.device)  # (L, B, H, T, T)
    for b, n in enumerate(lengths(attention_mask)):
        out[:, b, :, :n, :n] = fn(input_ids[b, :n]).to(out.device, torch.float32)
    return list(out)


def joint_maps(maps: torch.Tensor) -> torch.Tensor:
    """Joint maps through the layers (Abnar & Zuidema 2020): R_0 = M_0, R_l = M_l R_{l-1}.

    maps: (L, B, T, T) row-stochastic per layer. Returns (L, B, T, T)."""
    out = [maps[0]]
    for l in range(1, maps.shape[0]):
        out.append(maps[l] @ out[-1])
    return torch.stack(out)


@torch.inference_mode()
def iter_maps(measure: Measure, model: torch.nn.Module, items, pad_id: int, device: str = "cpu",
              max_tokens: int = 4096, max_batch_size: int = 64, desc: str = "maps", progress: bool = True):
    """Yield ``(k, (L, H', T_k, T_k) float32 piece maps)`` of every :class:`~probes.model.inputs.Encoded`
    ``items[k]`` (length batches, in batch order): :func:`probes.model.hooks.iter_attention` for any kind."""
    model = model.to(device)
    batches = length_batches([it.n_pieces for it in items], max_tokens, max_batch_size)
    with tqdm(total=len(items), desc=desc, unit="seq", disable=None if progress else True) as bar:
        for batch in batches:
            its = [items[b] for b in batch]
            inp = {k: v.to(device) for k, v in pad_encoded(its, pad_id).items()}
            maps = torch.stack(measure(model, inp["input_ids"], inp["attention_mask"]), dim=1)  # (B, L, H', T, T)
            for j, (k, it) in enumerate(zip(batch, its)):
                t = it.n_pieces
                yield k, maps[j, :, :, :t, :t]
            bar.update(len(its))
