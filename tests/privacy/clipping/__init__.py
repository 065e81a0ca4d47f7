"""Tests of dplit/privacy/clipping."""
