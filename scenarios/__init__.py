"""scenarios: run small DDP trainings on several ranks, inject faults, measure the checks.

``python -m scenarios`` (``scenarios.cli``) runs scenario and campaign files. Three rooms:

* ``spec``: what to run, as data: scenario and campaign files (TOML) -> frozen records,
  the models and their synthetic data, the fault spaces, the trial plan, the guard
  configurations whose overhead is measured, the seeds;
* ``run``: running it: the ranks' sessions and commands, the persistent worker pool,
  torchrun, the campaign loop, ``trials.csv`` and the golden cache;
* ``report``: what came out: outcomes (detected / masked / escaped / crashed / hung),
  summary.json, report.md / report.html and the plots.

The harness uses the public API of ``sdc_guard`` only. The benchmarks that time the
library's parts live in ``bench/``.
"""
