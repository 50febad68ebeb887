"""The attack table of issue 60 as runnable checks.

``catalogue.py`` lists each attack (its area, what the attacker does, the failure it would be
if it failed, and the existing test that performs it and asserts the good behaviour);
``python -m tests.attack`` runs them all and writes ``reports/ATTACK.md`` and
``reports/attack.json``. The ``test_*.py`` modules here hold the attacks no other test made.
"""
