"""Running a campaign: the ranks, the commands they run, and what is kept on disk.

* ``session``: one scenario's DDP model, optimizer and guard on one rank, reused by trials;
* ``rank``: the commands (golden run, trial, overhead rounds) and ``RankRunner``;
* ``pool``: the persistent worker pool (crash and hang handling); ``distributed``: ranks
  started by torchrun; ``launch``: ``run_ranks`` for one-off multi-rank functions;
  ``forkserver``: the server both fork their ranks from, torch already imported;
* ``runner``: the campaign loop; ``store``: ``trials.csv`` and the golden cache;
  ``outlock``: one writer per output directory (``OUT/.lock``).
"""
