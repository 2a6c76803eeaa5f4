"""`python -m qkv` does what the `qkv` console script does."""

from qkv.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
