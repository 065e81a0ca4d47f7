"""Tests of dplit/privacy."""
