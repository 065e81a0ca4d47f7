"""Tests of dplit/release."""
