"""Benchmarks and device checks of ``sdc_guard`` (``python -m bench``; see ``bench.__main__``).

They time the library through its public API and the internal interface named as
such in one place (``sdc_guard.internal``), and run on the campaign harness
(``scenarios``) where they need ranks.
"""
