"""`python -m cpctl ...` is `cpctl ...` (for machines where the console script is not on PATH)."""

from cpctl.launch.cli import main

main()
