"""Entry point: download and verify a treebank's pinned files.

``python -m probes.data.fetch treebank=ewt`` (several: ``-m treebank=ewt,gum``); the target folder is
``paths.data_dir`` ($PROBES_DATA_DIR or <repo>/data). The treebank node is ``conf/treebank/<name>.yaml``.
"""

from __future__ import annotations

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="../../conf", config_name="fetch")
def main(cfg: DictConfig) -> None:
    treebank = instantiate(cfg.treebank)
    for split, path in treebank.fetch().items():
        print(f"{treebank.name}/{split}: {path}")


if __name__ == "__main__":
    main()
