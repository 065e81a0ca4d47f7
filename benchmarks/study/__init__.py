"""What every study shares: SmolLM2 and SST-2 sources, one arm as a dplit process, and the record of a run.

A study (``benchmarks.tying``, ...) declares its arms (a shipped config and the overrides of each) and its table;
:mod:`benchmarks.study.arm` runs and measures each arm, :mod:`benchmarks.study.sst2` prepares the model and the data
once, :mod:`benchmarks.study.record` describes the machine and commit and writes the results.
"""
