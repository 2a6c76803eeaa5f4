"""The `qkv` command line: one module per subcommand, registered in `qkv.cli.main`."""
