"""Concept bottlenecks: CBMs on a concept dictionary (``cbm``), CB-SAE (``cbsae``), and the probes and solvers they
share with the interventions."""
