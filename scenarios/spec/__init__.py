"""What to run, as data: scenario and campaign files (TOML) validated into frozen records.

* ``scenario``: a scenario file -> ``Scenario`` (its ``[guard]`` table is a
  ``sdc_guard.GuardConfig``); ``models``: the models, their synthetic data, ``DTYPES``;
* ``faults``: ``FaultSpace``, a matrix or sample of faults; ``campaign``: campaign files
  -> ``CampaignSpec``; ``trials``: the campaign's deterministic list of ``TrialSpec``;
* ``overhead``: the guard configurations whose step-time overhead is measured;
* ``seeds``: the one derivation of every seed; ``errors`` and ``tables``:
  ``ScenarioError``, the validators, TOML reading.
"""

from scenarios.spec.campaign import CampaignSpec, OverheadSpec, load_campaign
from scenarios.spec.errors import ScenarioError
from scenarios.spec.faults import FaultSpace
from scenarios.spec.scenario import Scenario, load_scenario, scenario_from_dict
from scenarios.spec.tables import read_toml
from scenarios.spec.trials import Chaos, TrialSpec, plan_trials

__all__ = [
    "CampaignSpec",
    "Chaos",
    "FaultSpace",
    "OverheadSpec",
    "Scenario",
    "ScenarioError",
    "TrialSpec",
    "load_campaign",
    "load_scenario",
    "plan_trials",
    "read_toml",
    "scenario_from_dict",
]
