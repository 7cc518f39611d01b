"""The survey: Clark et al.'s analyses, the sink metric and Table 3's probes run for several models, one command.

``python -m probes.survey -m`` runs ``conf/survey.yaml`` for the five real models (a Hydra multirun over
``encoder=``); each job runs the steps of :mod:`probes.survey.steps` for its model (:func:`run_survey`) and keeps
their tables as records under ``docs/results/five_models/<model>/<step>/``. ``python -m probes.survey.page``
writes the tables and figures of ``docs/beyond/five-models.md`` from those records (:mod:`probes.survey.page`).
"""

from probes.survey.run import model_facts, run_survey

__all__ = ["model_facts", "run_survey"]
