"""``python -m bench.synthetic``: the synthetic-data pipeline (:func:`bench.synthetic.sitting.main`).

The pipeline and its arguments: the package's docstring, ``python -m bench.synthetic --help``.
"""

from bench.synthetic.sitting import main

if __name__ == "__main__":
    main()
