"""Tests of dplit/backbone."""
