"""`python -m probes.analyze analysis=<name> [encoder=...] [data=...] [analysis.max_sentences=N]`.

The attention analyses (see :mod:`probes.analysis`); outputs go to the Hydra run dir
``logs/analyze/<name>/<timestamp>/``. A thin layer over :func:`probes.analysis.context.run_analysis`,
the function :func:`probes.api.analyze` (``probes.analyze`` in the Python API) calls too. One's own CoNLL-U
file: ``data=conllu data.treebank.files.dev=/abs/path/dev.conllu``.

Run this module, do not import it: ``import probes.analyze`` binds the name ``probes.analyze`` to the module,
in place of the API function.
"""

import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from probes.analysis.context import run_analysis
from probes.config import CONF_DIR, PROJECT_ROOT

os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="analyze")
def main(cfg: DictConfig) -> None:
    """Run ``cfg.analysis`` into the Hydra run dir (wandb as ``logger.use_wandb`` says)."""
    run_analysis(cfg, HydraConfig.get().runtime.output_dir, name=HydraConfig.get().runtime.choices.analysis)


if __name__ == "__main__":
    main()
