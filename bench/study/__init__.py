"""What every study shares: SmolLM2 and SST-2 sources, one arm as a dplit process, and the record of a run.

A study (``bench.tying``, ...) declares its arms (a shipped config and the overrides of each) and its table;
:mod:`bench.study.arm` runs and measures each arm, :mod:`bench.study.sst2` prepares the model and the data
once, :mod:`bench.study.record` describes the machine and commit and writes the results.
"""
