"""Tests of dplit/audit."""
