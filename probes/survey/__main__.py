"""``python -m probes.survey [-m] [encoder=...]`` (conf/survey.yaml): the survey's steps for each model."""

import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import probes.resolvers  # noqa: F401  (registers ${python:} and ${unique_now:})
from probes.config import CONF_DIR, PROJECT_ROOT
from probes.survey.run import run_survey

os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="survey")
def main(cfg: DictConfig) -> None:
    """Survey ``encoder=<model>``; its ``encoder.*`` overrides are passed to every step."""
    hc = HydraConfig.get()
    overrides = [str(o) for o in hc.overrides.task if str(o).startswith("encoder.")]
    run_survey(cfg, hc.runtime.choices.encoder, overrides)


if __name__ == "__main__":
    main()
