"""The command line: click wiring over the package's public pieces. Nothing imports it."""
