"""Token-to-token maps beyond attention weights: one measure object per map kind.

Every measure is called as ``measure(model, input_ids, attention_mask)`` on a right-padded batch and
returns one tensor per layer, ``L x (B, H', T, T)`` (float32; attention: the compute dtype), with
rows = the receiving position i and columns = the contributing position j (like attention: "i attends to j"); H' = the model's heads for
per-head measures (``per_head = True``), 1 for per-layer ones. Positions beyond a sentence's length
are zero or arbitrary and are cropped by the caller, so a sentence's block equals running it alone.
All model access goes through :mod:`probes.model.hooks` and :mod:`probes.model.structure`.

Kinds (``extract.maps=<kind>``; objects from ``extract.measures.<kind>`` in conf/extract/default.yaml):
``attention``, ``rollout``, ``flow`` (:mod:`.rollout`), ``norm``, ``norm_res_ln``, ``alti``
(:mod:`.norms`), ``value_zeroing`` (:mod:`.value_zeroing`), ``grad_attribution`` (:mod:`.gradient`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from hydra.utils import instantiate


class Measure:
    """Base class: ``__call__(model, input_ids (B, T), attention_mask (B, T)) -> L x (B, H', T, T)``."""

    per_head: bool = True
    max_pieces: int | None = None  # longest sequence (special tokens included) the measure accepts; None: any
    # whether the maps come from the model held in a mixed precision's compute dtype
    # (probes.model.frozen.compute_in); False: the measure reads the weights itself, as loaded
    mixed_precision: bool = False

    def heads(self, num_heads: int) -> int:
        """H' of the maps: the model's heads for per-head measures, else 1."""
        return num_heads if self.per_head else 1

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                 ) -> list[torch.Tensor]:
        raise NotImplementedError

    def layer_maps(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   layers: Sequence[int], token_type_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The maps of ``layers`` (0-based, in that order): ``len(layers) x (B, H', T, T)``. Computes every layer
        and keeps those asked for (rollout and the other joint kinds need them all); a measure that can stop
        early overrides it.

        Args:
            model: The frozen model.
            input_ids, attention_mask: (B, T), right-padded.
            layers: 0-based layers.
            token_type_ids: (B, T) segments of sentence pairs (BERT-style), read by measures that override this
                method (attention); the others run without them.
        """
        maps = self(model, input_ids, attention_mask)  # L x (B, H', T, T)
        return [maps[l] for l in layers]


DEFAULT_MEASURES = {"attention": {"_target_": "probes.measures.attention.Attention"}}  # no extract.measures node


def check_kind(maps: str, measures: Mapping | None, name: str = "extract.maps") -> None:
    """A KeyError unless ``maps`` is a kind of the ``extract.measures`` node; the message calls the value ``name``:
    the config key, or the argument the caller passed it as (``kind`` in :func:`probes.api.word_maps`)."""
    measures = measures or DEFAULT_MEASURES
    if maps not in measures:
        raise KeyError(f"{name}={maps!r} is not one of extract.measures: {', '.join(measures)}")


def build(maps: str, measures: Mapping | None) -> Measure:
    """The measure of kind ``maps`` from the ``extract.measures`` node (``{kind: {_target_: ...}}``; an unknown
    kind: :func:`check_kind`'s error)."""
    check_kind(maps, measures)
    return instantiate(dict(measures or DEFAULT_MEASURES)[maps])


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
