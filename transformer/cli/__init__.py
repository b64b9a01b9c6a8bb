"""The `transformer` command: parsing, what each verb does, and translate's lines in and out."""

from transformer.cli.entry import main  # the entry point `transformer.cli:main`; it imports nothing heavy

__all__ = ["main"]
