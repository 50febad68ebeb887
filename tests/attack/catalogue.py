"""The attacks of issue 60, each an existing test that performs it and asserts the good
behaviour.

An attack is what an attacker (the hardware, a full disk, a second writer, a careless user)
does to one of the five areas; ``guards_against`` is the failure it would be if the test
failed. ``python -m tests.attack`` runs every attack's test and reports the table.
"""

from __future__ import annotations

from dataclasses import dataclass

AREAS = ("checkpoints", "quarantine", "event log", "campaigns", "guard")
"""The five areas of issue 60: the checkpoints, the quarantine (Kubernetes remediation), the
event log, the campaigns (the ``scenarios`` harness) and the guard itself."""

FAILURES = ("silently wrong", "lost data", "hung", "crashed", "unclear error")
"""The failure classes of issue 60's table, in its order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Attack:
    """One attack and the test that makes it."""

    area: str
    """One of ``AREAS``."""
    what: str
    """The attack, in one sentence, as an attacker would do it."""
    guards_against: str
    """The failure it would be if the test failed: one of ``FAILURES``."""
    test: str
    """The pytest node id of the test that performs the attack and asserts the good
    behaviour (relative to the repository root)."""

    def __post_init__(self) -> None:
        if self.area not in AREAS:
            raise ValueError(f"Attack(area={self.area!r}): one of {AREAS}.")
        if self.guards_against not in FAILURES:
            raise ValueError(f"Attack(guards_against={self.guards_against!r}): one of "
                             f"{FAILURES}.")
        if "::" not in self.test:
            raise ValueError(f"Attack(test={self.test!r}): a pytest node id, "
                             f"'tests/.../test_x.py::test_name[param]'.")


_CV = "tests/sdc_guard/test_checkpoint_verify.py::"
_CS = "tests/sdc_guard/test_checkpoint_storage.py::"
_CK = "tests/sdc_guard/test_checkpoint.py::"
_REC = "tests/sdc_guard/test_recovery_dist.py::"
_KS = "tests/attack/test_killed_save.py::"
_QL = "tests/sdc_guard/test_quarantine_lease.py::"
_QB = "tests/sdc_guard/test_quarantine_bounds.py::"
_Q = "tests/sdc_guard/test_quarantine.py::"
_QR = "tests/sdc_guard/test_remediation_rules.py::"
_QD = "tests/sdc_guard/test_quarantine_dist.py::"
_QI = "tests/sdc_guard/test_quarantine_incluster.py::"
_API = "tests/attack/test_api_faults.py::"
_EV = "tests/sdc_guard/test_events.py::"
_CFG = "tests/sdc_guard/test_config.py::"
_CLO = "tests/scenarios/test_campaign_lost.py::"
_CLK = "tests/scenarios/test_campaign_lock.py::"
_CP = "tests/scenarios/test_campaign_paths.py::"
_CL = "tests/scenarios/test_campaign_limits.py::"
_SC = "tests/scenarios/test_scenarios.py::"
_SD = "tests/scenarios/test_scenarios_dist.py::"
_W = "tests/sdc_guard/test_watch_dist.py::"
_SO = "tests/attack/test_step_order.py::"
_G = "tests/sdc_guard/test_guard_dist.py::"
_R = "tests/sdc_guard/test_replay_dist.py::"

_BAD_LINE = "test_a_bad_line_is_reported_and_the_other_records_kept"
_SEEDS = "test_seeds_and_sizes_beyond_their_limit_are_refused_naming_it"
_TRIALS = "test_trial_counts_beyond_the_limit_are_refused_in_seconds"
_TOML = "test_bad_scenario_names_file_field_value_and_allowed"
_NAMES = "test_scenario_and_campaign_names_are_one_file_name"
_LOG_OUT = "test_an_event_log_outside_out_is_refused_naming_the_field"
_CONFIG = "test_bad_config_names_the_field"


def _a(area: str, what: str, guards_against: str, test: str) -> Attack:
    return Attack(area=area, what=what, guards_against=guards_against, test=test)


_CKPT = "checkpoints"
_QUAR = "quarantine"
_LOG = "event log"
_CAMP = "campaigns"
_GUARD = "guard"

ATTACKS: tuple[Attack, ...] = (
    # -- checkpoints: issue 60, Why 1-3 --------------------------------------------------------
    _a(_CKPT, "a rank repaired once fails again later: its window opens at the first repair, "
       "after keep pruned the clean checkpoints before it", "lost data",
       _CV + "test_the_newest_checkpoint_before_a_repair_is_kept_inside_the_repair_window"),
    _a(_CKPT, "after a rollback, the abandoned timeline's refused checkpoints fill keep's "
       "places, and the fault comes back", "lost data",
       _CV + "test_checkpoints_a_window_refuses_do_not_count_against_keep"),
    _a(_CKPT, "a save on a full disk (os.write fails with ENOSPC half way), in the foreground "
       "and in the background", "lost data",
       _CS + "test_a_save_without_space_leaves_nothing_and_names_the_file_and_the_free_space"),
    _a(_CKPT, "the disk fills between a data file's commit and its manifest's", "lost data",
       _CS + "test_a_manifest_that_finds_no_space_takes_its_data_file_with_it"),
    _a(_CKPT, "a killed save's temporary file and a data file without its manifest left in "
       "the directory", "lost data",
       _CS + "test_what_a_killed_save_left_is_found_logged_and_removed_by_the_next_save"),
    _a(_CKPT, "restore on storage that refuses every write (full or read-only) while good "
       "checkpoints exist", "lost data",
       _CS + "test_restore_on_read_only_storage_succeeds_when_a_good_checkpoint_exists[True]"),
    _a(_CKPT, "a detection whose window cannot be written to windows.json (the disk is full "
       "at detection time)", "crashed",
       _CS + "test_a_detection_whose_window_cannot_be_written_is_logged_not_raised"),
    _a(_CKPT, "a 2-rank save whose writer (rank 0) runs out of space", "crashed",
       _CS + "test_every_rank_raises_the_writers_storage_error[False]"),
    _a(_CKPT, "a 2-rank background save whose writer runs out of space on its thread",
       "crashed", _CS + "test_every_rank_raises_the_writers_storage_error[True]"),
    _a(_CKPT, "a second job started on the first job's checkpoint directory", "lost data",
       _CS + "test_a_second_job_is_refused_with_the_reason_and_the_fix"),
    _a(_CKPT, "a checkpoint's weights edited and its manifest's size and hash fixed up to "
       "match", "silently wrong",
       _CV + "test_a_refused_checkpoint_leaves_the_model_as_it_was"),
    _a(_CKPT, "step 0's data file copied under step 1's name with the manifest fixed up, and "
       "a payload's generation edited", "silently wrong",
       _CV + "test_the_manifest_and_the_payload_must_agree_on_step_and_generation"),
    _a(_CKPT, "step 1's manifest rewritten to name step 0's data file", "silently wrong",
       _CV + "test_a_manifest_that_points_at_another_checkpoints_file_is_refused"),
    _a(_CKPT, "windows.json deleted after a detection", "silently wrong",
       _CV + "test_windows_lost_or_damaged_fail_safe[deleted]"),
    _a(_CKPT, "windows.json edited to drop a window (its checksum left as it was)",
       "silently wrong", _CV + "test_windows_lost_or_damaged_fail_safe[edited]"),
    _a(_CKPT, "windows.json replaced by an older copy from before the detection",
       "silently wrong", _CV + "test_windows_lost_or_damaged_fail_safe[older]"),
    _a(_CKPT, "windows.json overwritten with bytes that do not parse", "silently wrong",
       _CV + "test_windows_lost_or_damaged_fail_safe[unparseable]"),
    _a(_CKPT, "windows.json deleted where no manifest vouches for any verified step",
       "silently wrong",
       _CV + "test_windows_lost_without_any_verified_step_restore_nothing"),
    _a(_CKPT, "windows.json damaged before the first checkpoint exists", "lost data",
       _CV + "test_a_damaged_windows_file_without_checkpoints_is_replaced_by_the_first_save"),
    _a(_CKPT, "restore an SGD checkpoint into an AdamW run", "silently wrong",
       _CV + "test_a_checkpoint_of_another_optimizer_type_is_refused_by_name"),
    _a(_CKPT, "restore a float32 checkpoint into a bfloat16 model", "unclear error",
       _CV + "test_a_checkpoint_of_another_dtype_is_refused_not_called_corrupt"),
    _a(_CKPT, "restore a checkpoint whose buffers have other shapes", "silently wrong",
       _CV + "test_a_checkpoint_with_buffers_of_other_shapes_is_refused_before_anything_loads"),
    # -- checkpoints: handled well before ------------------------------------------------------
    _a(_CKPT, "a checkpoint's data file truncated", "silently wrong",
       _CK + "test_a_damaged_checkpoint_is_refused_by_name_and_the_older_one_used"
       "[<lambda>-truncated]"),
    _a(_CKPT, "a byte of a checkpoint's data file flipped", "silently wrong",
       _CK + "test_a_damaged_checkpoint_is_refused_by_name_and_the_older_one_used"
       "[<lambda>-corrupt]"),
    _a(_CKPT, "a checkpoint's data file made unreadable", "crashed",
       _CK + "test_a_damaged_checkpoint_is_refused_by_name_and_the_older_one_used"
       "[<lambda>-cannot be read]"),
    _a(_CKPT, "a checkpoint whose state does not match its recorded fingerprint",
       "silently wrong",
       _CK + "test_a_state_that_does_not_match_its_fingerprint_is_refused"),
    _a(_CKPT, "a checkpoint file that runs code when unpickled", "silently wrong",
       _CK + "test_loading_never_unpickles_arbitrary_objects"),
    _a(_CKPT, "keep=1 with audits every 4 steps: pruning the last checkpoint verified clean",
       "lost data", _CK + "test_keep_never_deletes_the_newest_checkpoint_verified_clean"),
    _a(_CKPT, "restart a job after a detection and restore a checkpoint inside its window",
       "silently wrong",
       _CK + "test_the_suspect_window_refuses_checkpoints_inside_it_and_survives_a_restart"),
    _a(_CKPT, "a background write that fails on its thread", "lost data",
       _CK + "test_a_failed_background_write_is_raised_by_wait_and_leaves_no_manifest"),
    _a(_CKPT, "restore another model's or another optimizer's checkpoint", "silently wrong",
       _CK + "test_a_checkpoint_of_another_model_or_optimizer_is_refused_before_anything_loads"),
    _a(_CKPT, "save extra states under names restore does not know", "unclear error",
       _CK + "test_extra_states_are_checked_by_name_before_anything_is_written"),
    _a(_CKPT, "kill -9 of the training process while a save writes its data", "lost data",
       _KS + "test_kill_9_during_a_save_restores_the_newest_committed_checkpoint"
       "[writing-data]"),
    _a(_CKPT, "kill -9 of the training process a moment after a save returned", "lost data",
       _KS + "test_kill_9_during_a_save_restores_the_newest_committed_checkpoint"
       "[a-moment-later]"),
    _a(_CKPT, "the same rank repaired twice inside the repair window", "silently wrong",
       _REC + "test_a_second_repair_of_the_same_rank_is_a_permanent_fault"),
    # -- quarantine: issue 60, Why 4 -----------------------------------------------------------
    _a(_QUAR, "the breaker keeps a convicted rank's node in service: the job must stop with "
       "the permanent exit code, not a restart onto the same node", "silently wrong",
       _Q + "test_restart_codes_say_restart_after_a_quarantine_and_stop_when_none_held"),
    _a(_QUAR, "two guard instances of one job with max_nodes=1, both reading before either "
       "writes", "silently wrong",
       _QL + "test_two_instances_of_one_job_cordon_one_node_when_max_nodes_is_one"),
    _a(_QUAR, "another writer updates the job's Lease between our read and our write",
       "silently wrong", _QL + "test_a_lease_conflict_is_read_again_and_judged_again"),
    _a(_QUAR, "a cordon that fails after its Lease reservation", "silently wrong",
       _QL + "test_a_failed_cordon_gives_its_reservation_back"),
    _a(_QUAR, "RBAC without the leases rights the shared count needs", "unclear error",
       _QL + "test_without_lease_rights_nothing_is_cordoned_and_the_fix_is_named"),
    _a(_QUAR, "a hanging API server with request_timeout_s=1, retries=0", "hung",
       _QB + "test_one_timeout_no_retries_is_one_request_of_that_timeout"),
    _a(_QUAR, "a node list that fails every time, with the default retries", "hung",
       _QB + "test_a_failing_list_takes_at_most_the_stated_worst_case"),
    _a(_QUAR, "release --request-timeout 3 against a hanging server", "hung",
       _QB + "test_release_with_a_request_timeout_is_bounded"),
    _a(_QUAR, "a detection whose detail is several MiB", "silently wrong",
       _QB + "test_a_detail_of_several_mib_still_cordons_and_taints"),
    _a(_QUAR, "a node whose annotations are full of other tools' data", "silently wrong",
       _QB + "test_a_node_whose_annotations_are_full_is_still_cordoned"),
    _a(_QUAR, "release of a node where another tool holds a taint of our key with another "
       "effect", "lost data",
       _QB + "test_release_keeps_another_tools_taint_with_our_key_and_another_effect"),
    _a(_QUAR, "an administrator cordons a node we already quarantined, then we release it",
       "silently wrong",
       _QB + "test_release_names_other_taints_and_can_keep_the_cordon"),
    _a(_QUAR, "a kubeconfig that is not valid YAML", "unclear error",
       _QB + r"test_a_malformed_kubeconfig_is_a_named_one_line_error[clusters: [unclosed\n"
       r"-not valid YAML]"),
    _a(_QUAR, "a kubeconfig whose current context does not exist", "unclear error",
       _QB + r"test_a_malformed_kubeconfig_is_a_named_one_line_error[apiVersion: v1\n"
       r"kind: Config\ncurrent-context: nowhere\ncontexts: []\n-nowhere]"),
    _a(_QUAR, "a kubeconfig that is a YAML list", "unclear error",
       _QB + r"test_a_malformed_kubeconfig_is_a_named_one_line_error[- just\n- a list\n"
       r"-not a mapping]"),
    # -- quarantine: handled well before -------------------------------------------------------
    _a(_QUAR, "a kubelet-like writer changes the node between our read and our write",
       "lost data", _Q + "test_a_real_version_conflict_keeps_the_other_writers_change"),
    _a(_QUAR, "the API server answers 500 twice to the cordon", "silently wrong",
       _Q + "test_server_errors_are_retried"),
    _a(_QUAR, "RBAC forbids patching nodes", "unclear error",
       _Q + "test_forbidden_names_the_verb_and_resource"),
    _a(_QUAR, "a suspect on a node that does not exist", "unclear error",
       _Q + "test_a_missing_node_is_named"),
    _a(_QUAR, "restart the job after a quarantine and detect again", "silently wrong",
       _Q + "test_the_breaker_survives_a_restart"),
    _a(_QUAR, "a repeat detection on a node already held", "silently wrong",
       _Q + "test_a_repeat_on_a_held_node_is_evidence_not_a_breaker_trip"),
    _a(_QUAR, "release of a node someone else cordoned before us", "silently wrong",
       _Q + "test_release_refuses_a_node_someone_else_cordoned_first"),
    _a(_QUAR, "the quarantine CLI pointed at a server that refuses it", "unclear error",
       _Q + "test_cli_errors_are_one_line"),
    _a(_QUAR, "every rank a suspect at once (a software fault) in a guarded run",
       "silently wrong",
       _QD + "test_every_rank_suspect_trips_the_breaker_and_cordons_nothing"),
    _a(_QUAR, "a guarded run with the default dry run", "silently wrong",
       _QD + "test_dry_run_is_the_default_and_stores_nothing"),
    _a(_QUAR, "the API server killed while the quarantine talks to it", "hung",
       _QD + "test_an_api_server_killed_mid_run_leaves_training_going"),
    _a(_QUAR, "an API server that hangs every request during a guarded run", "hung",
       _QD + "test_a_hanging_api_server_does_not_slow_the_steps"),
    _a(_QUAR, "an API server answering 500 to every request during a guarded run", "hung",
       _API + "test_an_api_server_that_refuses_every_request_never_slows_training[500]"),
    _a(_QUAR, "an API server answering 403 to every request during a guarded run", "hung",
       _API + "test_an_api_server_that_refuses_every_request_never_slows_training[403]"),
    _a(_QUAR, "an API server answering 409 to every write during a guarded run", "hung",
       _API + "test_an_api_server_that_refuses_every_request_never_slows_training[409]"),
    _a(_QUAR, "a pod with a rotated or wrong service account token", "unclear error",
       _QI + "test_a_rotated_or_wrong_token_is_refused_by_name"),
    # -- event log: issue 60, And ----------------------------------------------------------------
    _a(_LOG, "a line of invalid UTF-8 in the event log", "lost data",
       _EV + _BAD_LINE + r'[{"event": "x", "note": "\xff\xfe"}-invalid UTF-8 at byte 24]'),
    _a(_LOG, "a line that is not JSON in the event log", "lost data",
       _EV + _BAD_LINE + "[{not json-not JSON]"),
    _a(_LOG, "a line that is a JSON array, not an object", "silently wrong",
       _EV + _BAD_LINE + "[[1, 2, 3]-not a JSON object (a JSON array)]"),
    _a(_LOG, "a line that is JSON null", "silently wrong",
       _EV + _BAD_LINE + "[null-not a JSON object (a JSON null)]"),
    _a(_LOG, "a value nested 5000 deep (past Python's recursion limit)", "crashed",
       _EV + _BAD_LINE + "[bad6-nested deeper than 64 levels]"),
    _a(_LOG, "a value nested 100 deep (parses, past the log's depth limit)", "lost data",
       _EV + _BAD_LINE + "[bad7-nested deeper than 64 levels]"),
    _a(_LOG, "an integer of 5000 digits (past Python's int conversion limit)", "crashed",
       _EV + _BAD_LINE + "[bad8-a number too large (5000 digits]"),
    _a(_LOG, "a step of 2**64, beyond 64 bits", "lost data",
       _EV + _BAD_LINE + '[{"step": 18446744073709551616}-a number too large '
       '(18446744073709551616]'),
    _a(_LOG, "a torn last line (a rank killed while writing)", "lost data",
       _EV + "test_an_unfinished_last_line_is_reported_a_whole_one_kept"),
    _a(_LOG, "a thousand bad lines in one log", "unclear error",
       _EV + "test_many_bad_lines_one_warning_that_counts_them"),
    _a(_LOG, "append to a log whose tail was torn by a killed writer", "lost data",
       _CFG + "test_event_log_appends_whole_lines_and_skips_a_torn_tail"),
    _a(_LOG, "an event_log path that cannot be written (its parent is a file)", "crashed",
       _CFG + "test_an_unwritable_event_log_is_named_at_once_and_never_stops_a_detection"),
    # -- campaigns: issue 60, Why 5 and And ------------------------------------------------------
    _a(_CAMP, "a rank killed from outside in the middle of a trial", "silently wrong",
       _CLO + "test_a_rank_killed_mid_trial_is_retried_once_then_lost_and_crashed_keeps_"
       "its_meaning"),
    _a(_CAMP, "a campaign whose trials are lost twice, then resumed", "silently wrong",
       _CLO + "test_the_campaign_writes_lost_rows_lists_them_and_a_retry_that_runs_keeps_"
       "its_outcome"),
    _a(_CAMP, "two campaigns on one --out at once, then the first killed", "lost data",
       _CLK + "test_a_second_writer_is_refused_with_the_holder_and_a_killed_holder_blocks_"
       "nothing"),
    _a(_CAMP, "run and campaign started on an --out another run holds", "lost data",
       _CLK + "test_run_and_campaign_on_a_held_out_are_refused_before_anything_is_written"),
    _a(_CAMP, "merge and report on an --out a campaign is writing", "silently wrong",
       _CLK + "test_merge_and_report_refuse_a_directory_another_run_writes"),
    _a(_CAMP, "a scenario named '..'", "silently wrong", _CP + _NAMES + "[..]"),
    _a(_CAMP, "a scenario named '/etc'", "silently wrong", _CP + _NAMES + "[/etc]"),
    _a(_CAMP, "a scenario named 'a/b'", "silently wrong", _CP + _NAMES + "[a/b]"),
    _a(_CAMP, "a scenario named '.hidden'", "silently wrong", _CP + _NAMES + "[.hidden]"),
    _a(_CAMP, "[guard] event_log an absolute path", "silently wrong",
       _CP + _LOG_OUT + "[/tmp/events.jsonl-an absolute path leaves the output directory]"),
    _a(_CAMP, "[guard] event_log '../events.jsonl'", "silently wrong",
       _CP + _LOG_OUT + "[../events.jsonl-'..' leaves the output directory]"),
    _a(_CAMP, "[guard] event_log 'logs/../../events.jsonl'", "silently wrong",
       _CP + _LOG_OUT + "[logs/../../events.jsonl-'..' leaves the output directory]"),
    _a(_CAMP, "[guard] event_log under a symbolic link that leads outside --out",
       "silently wrong",
       _CP + "test_an_event_log_behind_a_symlink_leading_out_is_refused_when_the_run_starts"),
    _a(_CAMP, "a scenario seed of 2**64", "crashed",
       _CL + _SEEDS + "[-18446744073709551616-seed-[0, 9223372036854775807]]"),
    _a(_CAMP, "a fault's seed of -1", "crashed",
       _CL + _SEEDS + r'[\n[[faults]]\nsite = "weight_storage"\nrank = 1\nstep = 2\n'
       r'target = "net.0.weight"\nbits = [3]\nseed = -1\n-0-faults[0].seed-'
       r'[0, 9223372036854775807]]'),
    _a(_CAMP, "a fault burst beyond 64 bits", "crashed",
       _CL + _SEEDS + "[extra4-0-faults[0].burst-[1, 64]]"),
    _a(_CAMP, "a replay interval of 10**20 in [sample]", "crashed",
       _CL + _SEEDS + r'[[sample]\nsites = ["weight_storage"]\ntrials_per_site = 2\n'
       r'replay_intervals = [99999999999999999999]\n-0-sample.replay_intervals-[0, 100000]]'),
    _a(_CAMP, "clean_trials = 10**9", "hung",
       _CL + _TRIALS + r"[clean_trials = 1000000000\n-clean_trials]"),
    _a(_CAMP, "trials_per_site = 10**9 in [sample]", "hung",
       _CL + _TRIALS + r"[[sample]\ntrials_per_site = 1000000000\n-sample.trials_per_site]"),
    _a(_CAMP, "a sample margin of 1e-6 (a sample size of billions)", "hung",
       _CL + _TRIALS + r"[[sample]\nmargin = 0.000001\n-sample]"),
    _a(_CAMP, "a matrix repeated 1000 times", "hung",
       _CL + _TRIALS + r"[[matrix]\nsteps = [1, 2, 3, 4, 5]\nrepeat = 1000\n-matrix]"),
    _a(_CAMP, "a model beyond the parameter limit", "crashed",
       _CL + "test_a_model_beyond_the_parameter_limit_is_refused_without_building_it"),
    _a(_CAMP, "world_size = 0 in a scenario", "unclear error",
       _SC + _TOML + r"[world_size = 0\n-world_size-0]"),
    _a(_CAMP, "[guard] replay_interval = -1", "unclear error",
       _SC + _TOML + r"[[guard]\nreplay_interval = -1\n-guard.replay_interval--1]"),
    _a(_CAMP, "[matrix] steps beyond the scenario's steps", "unclear error",
       _SC + _TOML + r"[[matrix]\nsteps = [40]\n-matrix.steps-40]"),
    _a(_CAMP, "a fault on rank 5 of a 3-rank scenario", "unclear error",
       _SC + _TOML + r'[[[faults]]\nsite = "weight_storage"\nrank = 5\nstep = 1\n'
       r'target = "net.0.weight"\nbits = [3]\n-faults[0].rank-5]'),
    _a(_CAMP, "a bad scenario run from the command line", "unclear error",
       _SC + "test_cli_subprocess_has_no_traceback"),
    _a(_CAMP, "a torn last line in trials.csv", "lost data",
       _SC + "test_trial_table_appends_and_repairs_a_torn_line"),
    _a(_CAMP, "a trial process that hangs", "hung", _SC + "test_watchdog_ends_a_hung_process"),
    _a(_CAMP, "the ranks go down with a trial in flight", "lost data",
       _SC + "test_a_trial_in_flight_when_the_ranks_went_down_is_recorded"),
    _a(_CAMP, "SIGKILL of the campaign's coordinator, then resume", "lost data",
       _SD + "test_killed_campaign_resumes_without_loss_or_duplicates"),
    # -- guard: issue 60, And --------------------------------------------------------------------
    _a(_GUARD, "a rank that skips a step (rank 1 calls 0, 1, 2, 4, ...)", "hung",
       _W + "test_a_rank_at_another_step_is_a_named_error_on_every_rank[weights-vote]"),
    _a(_GUARD, "a rank that runs one step twice, with the replay audited every step", "hung",
       _SO + "test_a_rank_that_repeats_or_goes_back_a_step_is_named_on_every_rank[repeated]"),
    _a(_GUARD, "a rank that goes back a step, with the replay audited every step", "hung",
       _SO + "test_a_rank_that_repeats_or_goes_back_a_step_is_named_on_every_rank[back]"),
    _a(_GUARD, "a rank resumed one step ahead of the others, replay on", "hung",
       _R + "test_ranks_at_other_steps_are_an_error_of_the_loop_never_a_conviction"),
    _a(_GUARD, "a rank that stops calling step", "hung",
       _W + "test_a_rank_that_stops_calling_step_is_named_by_the_others"),
    _a(_GUARD, "an optimizer that holds none of the model's parameters", "silently wrong",
       _CFG + "test_an_optimizer_of_another_model_is_refused"),
    _a(_GUARD, "guard.step(2**63)", "unclear error",
       _CFG + "test_a_step_beyond_64_bits_is_named"),
    _a(_GUARD, "GuardConfig(weights_interval=-1)", "unclear error",
       _CFG + _CONFIG + "[kwargs0-weights_interval must be >= 0]"),
    _a(_GUARD, "GuardConfig(nonfinite=1)", "unclear error",
       _CFG + _CONFIG + "[kwargs4-nonfinite must be True or False]"),
    _a(_GUARD, "GuardConfig(seed=2**64)", "unclear error",
       _CFG + _CONFIG + r"[kwargs6-seed must be an int in 0\\.\\.2\\*\\*63-1]"),
    _a(_GUARD, "GuardConfig(collective_timeout_s=0)", "unclear error",
       _CFG + _CONFIG + "[kwargs8-collective_timeout_s must be a number of seconds > 0]"),
    _a(_GUARD, "GuardConfig(replay_interval=5) without deterministic", "unclear error",
       _CFG + _CONFIG + "[kwargs11-replay_interval=5 needs deterministic=True]"),
    _a(_GUARD, "a loss_fn that returns a tensor of shape [3, 2]", "unclear error",
       _CFG + "test_a_bad_batch_or_loss_is_named[kwargs0-ValueError-must return a scalar "
       r"loss, got a tensor of shape \\[3, 2\\]: reduce it]"),
    _a(_GUARD, "a batch_for that returns None", "unclear error",
       _CFG + r"test_a_bad_batch_or_loss_is_named[kwargs2-ValueError-batch_for\\(0, 0\\) "
       "returned None]"),
    _a(_GUARD, "a DDP model with a comm hook of its own", "silently wrong",
       _CFG + "test_guard_refuses_a_ddp_model_with_a_comm_hook_of_its_own"),
    _a(_GUARD, "a windows.json that cannot be written when a detection must quarantine",
       "crashed", _CFG + "test_a_suspect_window_that_cannot_be_recorded_still_quarantines"),
    _a(_GUARD, "a loss_fn that calls the module, bypassing DDP", "silently wrong",
       _G + "test_a_loss_fn_that_bypasses_ddp_is_named[True]"),
    _a(_GUARD, "ranks whose optimizer settings differ", "silently wrong",
       _G + "test_optimizer_settings_that_differ_are_named_not_a_rank_convicted[False]"),
    _a(_GUARD, "replicas whose parameters start apart", "silently wrong",
       _G + "test_replicas_that_start_apart_are_named_not_a_rank_convicted"
       "[parameters-False]"),
    _a(_GUARD, "a batch_for that ignores its rank, replay on", "silently wrong",
       _R + "test_a_batch_for_that_ignores_its_rank_is_named_not_every_rank_convicted"),
    _a(_GUARD, "a loss that communicates, replay on", "hung",
       _R + "test_a_loss_that_communicates_is_refused_by_the_replay_not_convicted"),
)
"""Every attack, grouped by area; ``tests/attack/test_catalogue.py`` checks the list."""
