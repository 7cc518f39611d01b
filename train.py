"""Train and evaluate a probe: `python train.py [experiment=...] [overrides]` (see README)."""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from probes.train import train

    metrics = train(cfg)
    return metrics.get(cfg.get("optimized_metric", "val/uas_best"))


if __name__ == "__main__":
    main()
