"""Tests of dplit/privacy/accounting."""
