"""Train and evaluate a probe: `python train.py [experiment=...] [overrides]` (see README); continue a killed
run in its folder: `python train.py resume=<run folder>`. A failure prints one message (the error and the run's
log file, which holds its traceback) and exits with status 1 (:func:`probes.train.reported`)."""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

import probes.resolvers  # noqa: F401  (${unique_now:...} in conf/hydra/default.yaml)

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))  # before the package reads it

from probes.train import failure_logged, objective, reported, resume_from_argv, run_ddp_rank, train  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    """Runs one job; returns ``metrics[optimized_metric]``, the value a sweeper (Optuna) optimises."""
    with failure_logged():
        return objective(train(cfg), cfg.optimized_metric)


if __name__ == "__main__":
    # a DDP rank > 0 trains from rank 0's config, in rank 0's run folder; resume=<run folder> continues a run
    with reported():
        if not run_ddp_rank() and not resume_from_argv():
            main()
