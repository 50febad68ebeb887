"""scenarios: run small DDP trainings on several ranks, inject faults, measure the checks.

``python -m scenarios`` (``scenarios.cli``) runs scenario and campaign files. The parts:

* ``spec``: scenario files (TOML) -> frozen, validated ``Scenario`` records; ``ScenarioError``;
* ``campaign``: campaign files, the fault matrix / sample (Leveugle et al.), ``TrialSpec`` ids;
* ``models``: the models and their deterministic synthetic data;
* ``rank``: what each rank does (sessions reused across trials, golden, trial, overhead);
* ``pool``: the persistent worker pool (crash and hang handling); ``distributed``: torchrun;
* ``runner``: the campaign loop; ``store``: ``trials.csv`` and the golden cache;
* ``outcome``: detected / masked / escaped / crashed / hung, latency, containment;
* ``report`` and ``plots``: summary.json, report.md, report.html, PNGs;
* ``throughput``: persistent pool against spawn per trial; ``bench``: sdc_guard benchmarks;
  ``launch``: ``run_ranks`` for tests and one-off multi-rank functions.
"""
