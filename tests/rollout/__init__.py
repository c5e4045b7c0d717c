"""Rollout engine tests."""
