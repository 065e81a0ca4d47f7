"""dplit's tests; a package so that test modules import the shared helpers as ``tests.<module>``."""
