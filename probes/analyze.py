"""`python -m probes.analyze analysis=<name> [encoder=...] [data=...] [analysis.max_sentences=N]`.

The attention analyses (see :mod:`probes.analysis`); outputs go to the Hydra run dir
``logs/analyze/<name>/<timestamp>/``. A thin layer over :func:`probes.analysis.context.run_analysis`,
the function :func:`probes.analyze` (the Python API) calls too. One's own CoNLL-U file:
``data=conllu data.treebank.files.dev=/abs/path/dev.conllu``.
"""

import os
import sys
import types

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from probes import api
from probes.analysis.context import run_analysis
from probes.config import CONF_DIR, PROJECT_ROOT

os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="analyze")
def main(cfg: DictConfig) -> None:
    """Run ``cfg.analysis`` into the Hydra run dir (wandb as ``logger.use_wandb`` says)."""
    run_analysis(cfg, HydraConfig.get().runtime.output_dir, name=HydraConfig.get().runtime.choices.analysis)


class _CallableModule(types.ModuleType):
    """``import probes.analyze`` binds this module to the name ``probes.analyze``, which is also the API function
    :func:`probes.api.analyze`; calling the module calls the function, so both spellings keep working."""

    def __call__(self, *args, **kwargs):
        return api.analyze(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
