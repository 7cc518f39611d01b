"""`python -m probes.extract [overrides]`: build the attention caches that `train.py` reads."""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

import probes.resolvers  # noqa: F401  (${unique_now:} of the run folder)
from probes.extract.attention_caches import run

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[2]))


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    """Build the caches of ``cfg.splits`` (:func:`probes.extract.attention_caches.run`)."""
    run(cfg)


if __name__ == "__main__":
    main()
