"""Benchmarks: task training harnesses and (later) speed measurements."""
