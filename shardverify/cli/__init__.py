"""Command-line interface: one module per subcommand, wired together in main.py."""
