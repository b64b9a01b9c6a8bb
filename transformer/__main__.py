"""`python -m transformer ...` is the same as the `transformer` console script (torchrun needs this form)."""

from transformer.cli import main

if __name__ == "__main__":
    main()
