"""Planted ground truths for the benchmarks and tests (not part of the installed library): ``synthetic`` (planted
atoms, hierarchies, two-model pairs for diffing) and ``geometry`` (concepts of heterogeneous geometry). Importable
as ``generators.*`` from bench/ scripts, and from tests (tests/conftest.py puts bench/ on the path)."""
