"""Summaries of finished runs: a Hydra callback that tabulates a multirun's metrics.json files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from probes.io import atomic_write_text

# Clark et al. 2019, Table 3 (UAS, PTB with Stanford dependencies, bert-base): row -> paper value.
CLARK_TABLE3 = {"right_branching": 26, "distance_glove": 58, "random_attn_glove": 30, "attn_only": 61, "attn_glove": 77}


def summarize(sweep_dir: str | Path, columns: tuple[str, ...] = ("val/uas_best", "test/uas", "test/uas_nopunct")) -> str:
    """Markdown table, one row per run folder holding metrics.json (named by its experiment tag)."""
    rows = []
    for m in sorted(Path(sweep_dir).glob("*/metrics.json")):
        cfg = OmegaConf.load(m.parent / ".hydra" / "config.yaml") if (m.parent / ".hydra").exists() else {}
        tags = list(cfg.get("tags", [])) if cfg else []
        name = next((t for t in tags if t in CLARK_TABLE3), m.parent.name)
        metrics = json.loads(m.read_text())
        rows.append([name, *[f"{100 * metrics[c]:.1f}" if c in metrics else "-" for c in columns],
                     str(CLARK_TABLE3.get(name, "-"))])
    head = ["row", *columns, "Clark et al."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


class SummaryCallback(Callback):
    """Writes `<sweep dir>/summary.md` when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        table = summarize(sweep)
        atomic_write_text(sweep / "summary.md", table)
        print(f"\n{sweep / 'summary.md'}:\n{table}")
