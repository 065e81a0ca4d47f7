"""Tests of dplit/tasks."""
