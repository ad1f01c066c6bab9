"""Fixture `local_tinker`: one local Tinker-compatible backend for the whole test session.

Owned by the local-backend work (issue 3); see DEVELOPING.md for the interface.
"""
