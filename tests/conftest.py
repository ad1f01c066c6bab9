"""Shared fixtures: the local Tinker backend and offline tokenizers (see DEVELOPING.md)."""
from fixtures_local import *  # noqa: F401,F403
from fixtures_tokenizers import *  # noqa: F401,F403
