"""Tests of dplit/data."""
