"""`python -m probes.analyze analysis=<name> [encoder=...] [data=...] [analysis.max_sentences=N]`.

Attention analyses of Clark et al. 2019 (see `probes.analysis`); outputs go to the Hydra run dir
`logs/analyze/<name>/<timestamp>/`.
"""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parents[1]))


@hydra.main(version_base="1.3", config_path="../conf", config_name="analyze")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from probes.analysis.context import run_analysis

    run_analysis(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
