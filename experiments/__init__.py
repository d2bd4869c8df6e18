"""Runnable walkthrough experiments (see WALKTHROUGH.md)."""
