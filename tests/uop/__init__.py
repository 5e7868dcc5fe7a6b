"""Tests of ember/uop."""
