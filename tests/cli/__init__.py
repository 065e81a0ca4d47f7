"""Tests of dplit/cli."""
