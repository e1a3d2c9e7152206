"""Benchmarks of devd, each against a baseline measured in the same run; run from a checkout, never shipped."""
