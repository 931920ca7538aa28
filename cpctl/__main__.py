"""`python -m cpctl ...` is `cpctl ...` (for machines where the console script is not on PATH)."""

from cpctl.cli import main

main()
