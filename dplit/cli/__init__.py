"""The ``dplit`` command line (``dplit.__main__`` is the console script; it imports :mod:`dplit.cli.main` lazily).

* :mod:`~dplit.cli.main`: the dispatch table from command to runner, a refusal as one ``dplit: error:`` line.
* :mod:`~dplit.cli.lightning_cli`: ``DPLitCLI`` and ``DPLitLMCLI`` (LightningCLI), ``run_cli``/``run_lm_cli``.
* :mod:`~dplit.cli.audit`: ``dplit audit`` and ``dplit lm audit`` (the ``audit`` section, the verdict).
* :mod:`~dplit.cli.release`: ``dplit export`` and ``dplit lm generate``.
* :mod:`~dplit.cli.messages`: jsonargparse's parse errors as one line naming the flag.
* :mod:`~dplit.cli.config_checks`: what is refused in a config before Lightning runs it.
* :mod:`~dplit.cli.run_summary`: where a run keeps its checkpoints, the line it prints when it ends.
* :mod:`~dplit.cli.launch`: torch.distributed launch variables inherited from a parent process, dropped; the
  process group a command started, destroyed when it ends.
"""
