"""Test helpers: fakes, multi-process harnesses, local clusters and shared checks."""
