"""``python -m dplit`` and the ``dplit`` console script: the dplit command line.

Help and a mistyped command are answered here, before torch and Lightning are imported (seconds).
"""

from __future__ import annotations

import os
import sys

from dplit.cli.terminal import front_door


def main(args: list[str] | None = None) -> None:
    """Run ``dplit`` on ``args`` (default ``sys.argv[1:]``): see :func:`dplit.cli.main.main`."""
    argv = list(sys.argv[1:] if args is None else args)
    try:
        status = front_door([arg for arg in argv if arg != "--debug"])
    except BrokenPipeError:  # `dplit --help | head`: the reader left; Python's documented way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    if status is not None:
        raise SystemExit(status)
    from dplit.cli.main import main as run  # torch, Lightning, transformers: seconds

    run(argv)


if __name__ == "__main__":
    main()
