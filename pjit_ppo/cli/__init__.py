"""Command-line entry points (absl apps). Installed as console scripts by setup.py and
wrapped by the scripts in `launch/`; nothing in the library imports this package."""
