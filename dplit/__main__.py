"""``python -m dplit`` and the ``dplit`` console script: the dplit command line.

Help and a mistyped command are answered here, before torch and Lightning are imported (seconds).
"""

from __future__ import annotations

import sys

from dplit.terminal import front_door


def main(args: list[str] | None = None) -> None:
    """Run ``dplit`` on ``args`` (default ``sys.argv[1:]``): see :func:`dplit.cli.main`."""
    argv = list(sys.argv[1:] if args is None else args)
    status = front_door([arg for arg in argv if arg != "--debug"])
    if status is not None:
        raise SystemExit(status)
    from dplit.cli import main as run  # torch, Lightning, transformers: seconds

    run(argv)


if __name__ == "__main__":
    main()
