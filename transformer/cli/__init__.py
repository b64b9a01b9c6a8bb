"""The `transformer` command: parsing, what each verb does, and translate's lines in and out."""

from transformer.cli.parser import main  # the entry point `transformer.cli:main`; parser imports nothing heavy

__all__ = ["main"]
