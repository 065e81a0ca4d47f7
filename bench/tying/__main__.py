"""``python -m bench.tying``: one sitting of the tying study (:func:`bench.tying.sitting.main`).

The study and its arguments: the package's docstring, ``python -m bench.tying --help``.
"""

from bench.tying.sitting import main

if __name__ == "__main__":
    main()
