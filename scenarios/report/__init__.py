"""What a campaign found: each trial's outcome, the summary, the report and its plots.

* ``outcome``: detected / masked / escaped / crashed / hung, latency, containment;
* ``summary``: ``summary.json`` (coverage, intervals, overhead, the recommended interval);
* ``render``: ``report.md`` and ``report.html``; ``plots``: the PNGs.
"""
