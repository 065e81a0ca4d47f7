"""``python -m dplit`` runs the dplit command line."""

from dplit.cli import main

if __name__ == "__main__":
    main()
