"""Test doubles shared by the test suites and the operator benchmarks; never shipped in the wheel."""
